"""Megatron-style log lines, the --metrics-file JSON lines and TensorBoard scalars.

One job: report an iteration from the rank that has the loss (the last rank of the last
pipeline stage). Iteration lines look like Megatron's, and like its lines show the lm loss
and the time per iteration averaged over the iterations since the last line
(--log-interval), plus a line at the last iteration:

     [2026-11-23 10:00:00] iteration        3/      10 | consumed samples:           12 |
     elapsed time per iteration (ms): 812.3 | learning rate: 1.000000E-03 | global batch
     size:     4 | lm loss: 5.512345E+00 | grad norm: 1.234 | number of skipped iterations:
     0 | number of nan iterations:   0 |

`--metrics-file PATH` gets one JSON object per iteration (iteration, lm_loss, grad_norm, lr,
tokens, tokens_per_s, attention_tflops: attention FLOP/s per rank counting only the query-key
pairs a document mask needs, forward and backward; iteration_ms; plan_wait_ms: how long the
reporting rank's steps waited for CP plans) and one per validation (kind "valid").

Megatron-LM's optional fields: --log-throughput adds "throughput per GPU (TFLOP/s/GPU)"
(model FLOPs, training/model_stats.py; metrics "model_tflops_per_gpu"), --log-num-zeros-in-grad
"num zeros" ("num_zeros_in_grad"), --log-params-norm "params norm" ("params_norm"),
--log-validation-ppl-to-tensorboard the validation perplexity as a TensorBoard scalar.

What it does not do: no timers breakdown, no memory report.
"""

from __future__ import annotations

import json
import math
import time

from megatron_eod.training.model_stats import attention_flops, model_flops

__all__ = ["Reporter"]


class Reporter:
    def __init__(self, args, is_reporting_rank: bool, vocab_size: int = 0):
        self.args, self.active, self.vocab_size = args, is_reporting_rank, vocab_size
        self.interval_seconds = self.interval_loss = self.interval_work = 0.0
        self.interval_iterations = self.interval_losses = 0
        self.metrics = open(args.metrics_file, "a") if (self.active and args.metrics_file) else None
        self.writer = None
        if self.active and args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print(" --tensorboard-dir given but tensorboard is not installed; skipping",
                      flush=True)
            else:
                self.writer = SummaryWriter(log_dir=args.tensorboard_dir)

    def iteration(self, iteration, seconds, lr, loss, grad_norm, skipped, nan, consumed,
                  attention_pairs, plan_wait_s=0.0, batch_size=None, params_norm=None,
                  num_zeros=None):
        """grad_norm is None when --clip-grad 0; batch_size is this iteration's global batch
        (it ramps with --rampup-batch-size); params_norm and num_zeros with
        --log-params-norm and --log-num-zeros-in-grad."""
        if not self.active:
            return
        a = self.args
        batch_size = batch_size or a.global_batch_size
        tokens = batch_size * a.seq_length
        flops = attention_flops(a, attention_pairs)
        record = {"iteration": iteration, "lm_loss": loss, "grad_norm": grad_norm, "lr": lr,
                  "tokens": tokens, "tokens_per_s": tokens / seconds,
                  "attention_tflops": flops / seconds / a.world_size / 1e12,
                  "iteration_ms": seconds * 1e3, "plan_wait_ms": plan_wait_s * 1e3}
        throughput = getattr(a, "log_throughput", False)
        if throughput:
            work = model_flops(a, self.vocab_size, tokens, attention_pairs)
            record["model_tflops_per_gpu"] = work / seconds / a.world_size / 1e12
            self.interval_work += work  # the line: the work since the last line / its time
        if params_norm is not None:
            record["params_norm"] = params_norm
        if num_zeros is not None:
            record["num_zeros_in_grad"] = num_zeros
        # The line's loss and time: averages since the last line, as Megatron-LM's (the
        # --metrics-file keeps each iteration's own).
        self.interval_seconds += seconds
        self.interval_iterations += 1
        if math.isfinite(loss):
            self.interval_loss, self.interval_losses = self.interval_loss + loss, \
                self.interval_losses + 1
        if iteration % a.log_interval == 0 or iteration == a.train_iters:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            mean_loss = self.interval_loss / self.interval_losses if self.interval_losses \
                else loss
            per_iteration = self.interval_seconds / self.interval_iterations
            work, spent = self.interval_work, self.interval_seconds
            self.interval_seconds = self.interval_loss = self.interval_work = 0.0
            self.interval_iterations = self.interval_losses = 0
            print(f" [{stamp}] iteration {iteration:8d}/{a.train_iters:8d} | consumed samples: "
                  f"{consumed:12d} | elapsed time per iteration (ms): {per_iteration * 1e3:.1f} | "
                  + ("" if not throughput else f"throughput per GPU (TFLOP/s/GPU): "
                     f"{work / spent / a.world_size / 1e12:.1f} | ") +
                  f"learning rate: {lr:.6E} | global batch size: {batch_size:5d} | "
                  f"lm loss: {mean_loss:.6E} | "
                  + ("" if grad_norm is None else f"grad norm: {grad_norm:.3f} | ")
                  + ("" if num_zeros is None else f"num zeros: {num_zeros:.1f} | ")
                  + ("" if params_norm is None else f"params norm: {params_norm:.3f} | ") +
                  f"number of skipped iterations: {skipped:3d} | "
                  f"number of nan iterations: {nan:3d} |", flush=True)
        self._write(record)
        if self.writer:
            for key in ("lm_loss", "grad_norm", "lr", "tokens_per_s", "attention_tflops",
                        "model_tflops_per_gpu", "params_norm", "num_zeros_in_grad"):
                if record.get(key) is not None:
                    self.writer.add_scalar(key, record[key], iteration)

    def validation(self, iteration, loss, label="validation", in_loop=False):
        """An evaluation's line, worded as Megatron-LM's: in the loop "validation loss at
        iteration N", after training "... at iteration N on validation set" / "on test set"."""
        if not self.active:
            return
        ppl = math.exp(min(20.0, loss))
        at = f"iteration {iteration}" + ("" if in_loop else f" on {label} set")
        line = (f" validation loss at {at} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {ppl:.6E} | ")
        print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
        self._write({"kind": "valid" if label == "validation" else "test",
                     "iteration": iteration, "lm_loss": loss})
        if self.writer:
            self.writer.add_scalar(f"{label} lm_loss", loss, iteration)
            if getattr(self.args, "log_validation_ppl_to_tensorboard", False):
                self.writer.add_scalar(f"{label} lm_loss ppl", ppl, iteration)

    def _write(self, record):
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def close(self):
        if self.metrics:
            self.metrics.close()
        if self.writer:
            self.writer.close()
