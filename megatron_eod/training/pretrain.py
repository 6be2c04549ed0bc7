"""The training loop behind `pretrain_gpt.py`: EoD-reset GPT pretraining under TP/PP/CP/DP.

One job: flags -> start-up -> model, optimizer, data -> iterations of megatron-core's
pipeline schedule with our step functions -> logging, validation, checkpoints. Each
iteration: megatron-core's micro-batch calculator says how many micro-batches this
iteration's (possibly ramping) global batch has; zero DDP's gradient buffers, run them
through the schedule (which calls `finalize_model_grads`: gradients summed over DP x CP, the
shared embedding over PP, layer norms over TP with sequence parallelism, all divided by the
global count of loss tokens), one step of megatron-core's optimizer, one LR schedule step
of as many samples. The reported lm loss is the global token-weighted mean over all
micro-batches, DP and CP ranks, so it is the same number at any CP size. With
--overlap-param-gather the forward pre-hooks gather the parameters (off for the first
iteration, around evaluation and before saving, as Megatron-LM does). With virtual pipeline
stages the rank holds several model chunks, each with its own stream of the same
micro-batches, and megatron-core's interleaved schedule runs them.

    pretrain(argv)   # parse, run, tear down; raises SystemExit(2) on a flag error

What it does not do: no `--pipeline-model-parallel-layout`, no MoE.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_eod.data.checks import DatasetError
from megatron_eod.data.tokenizers import padded_vocab_size
from megatron_eod.training.args import FlagError, parse_args
from megatron_eod.training.args_megatron_lm_only import no_effect_notice
from megatron_eod.training.collective_faults import exit_on_collective_fault
from megatron_eod.training.cp_flags import exit_with_error
from megatron_eod.megatron.batch_context import EodContextRegistry
from megatron_eod.megatron.imports import import_megatron
from megatron_eod.megatron.steps import is_dataset_built_on_rank
from megatron_eod.training import eod_wiring as wiring
from megatron_eod.training.checkpoint_args import checkpoint_args_notice
from megatron_eod.training.checkpoint_load import CheckpointError, load_checkpoint
from megatron_eod.training.checkpointing import needs_gloo_dp_groups, save_checkpoint
from megatron_eod.training.data import MicroBatches, build_datasets, build_tokenizer_from_args
from megatron_eod.training.initialize import initialize, shutdown
from megatron_eod.training.model import build_model
from megatron_eod.training.model_stats import model_flops, params_norm
from megatron_eod.training.optimizer import build_optimizer
from megatron_eod.training.reporting import Reporter
from megatron_eod.training.run_controls import RunControls

__all__ = ["NonFiniteError", "pretrain"]


class NonFiniteError(RuntimeError):
    """The loss or the grad norm became NaN/Inf (--check-for-nan-in-loss-and-grad)."""


def pretrain(argv=None):
    """Run a training job; returns this rank's per-iteration lm losses (nan off the last
    pipeline stage). Works under torchrun or inside an already initialised process group."""
    started = _now()  # --exit-duration-in-mins counts from here, as Megatron-LM's
    world_size = dist.get_world_size() if dist.is_initialized() else None
    try:
        args = parse_args(argv, world_size=world_size)
        args.gloo_dp_groups = needs_gloo_dp_groups(args)  # reads --load's tracker
    except FlagError as error:
        exit_with_error(error, 2)
    try:
        initialize(args, sys.argv[1:] if argv is None else argv)
    except BaseException as error:
        with contextlib.suppress(Exception):  # the start-up's own error is the one to see
            shutdown()  # what it set so far: deterministic algorithms, the CPU patches
        if isinstance(error, FlagError):  # flags differ by rank, --save not shared: every rank
            exit_with_error(error, 2)
        if isinstance(error, RuntimeError):  # a rank that never joined: one line
            exit_on_collective_fault(error, args.distributed_timeout_minutes)
        raise
    for notice in (checkpoint_args_notice(args), no_effect_notice(args)):
        if notice and dist.get_rank() == 0:
            print(notice, flush=True)
    controls = RunControls(args)  # the exit signal is heard from here on, as Megatron-LM's
    try:
        return _Trainer(args, started, controls).run()
    except (NonFiniteError, DatasetError, CheckpointError) as error:
        exit_with_error(error, 1 if isinstance(error, NonFiniteError) else 2)
    except RuntimeError as error:  # a collective that lost a rank: one line, else raised
        exit_on_collective_fault(error, args.distributed_timeout_minutes)
        raise
    finally:
        controls.close()
        shutdown()


def _one_or_list(functions):
    """megatron-core's schedules take one sync function, or one per model chunk."""
    return functions[0] if len(functions) == 1 else functions


def _now() -> float:
    return time.time()


class _Trainer:
    def __init__(self, args, started, controls):
        self.args = a = args
        self.started = started
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.ps = import_megatron("megatron.core.parallel_state")
        schedules = import_megatron("megatron.core.pipeline_parallel")
        finalize = import_megatron("megatron.core.distributed").finalize_model_grads
        tokenizer = build_tokenizer_from_args(a)
        vocab = padded_vocab_size(tokenizer.vocab_size, a.make_vocab_size_divisible_by,
                                  a.tensor_model_parallel_size)
        a.padded_vocab_size = vocab  # saved with the args, as Megatron-LM; --load compares it
        self.registry = EodContextRegistry()
        self.registry.capacity = max(self.registry.capacity, wiring.contexts_in_flight(a))
        self.chunks, config = build_model(a, self.registry, vocab)  # one per virtual stage
        self.optimizer, self.scheduler = build_optimizer(self.chunks, a)
        config.no_sync_func = _one_or_list([chunk.no_sync for chunk in self.chunks])
        if a.overlap_grad_reduce and a.align_grad_reduce:  # as Megatron-LM
            config.grad_sync_func = _one_or_list([c.start_grad_sync for c in self.chunks])
        config.finalize_model_grads_func = finalize
        config.grad_scale_func = self.optimizer.scale_loss
        self.calculator = import_megatron("megatron.core.num_microbatches_calculator")
        self.gathers_params = a.use_distributed_optimizer and a.overlap_param_gather
        self.hooks_on = self.gathers_params  # DDP registers them when it is built
        self.iteration, counters = 0, {}
        if a.load or a.pretrained_checkpoint:
            self.iteration, counters = load_checkpoint(a, self.chunks, self.optimizer,
                                                       self.scheduler)
        # A checkpoint this run would write again unchanged: the one it resumed from, when
        # --load and --save are one directory and no step was made since.
        self.resumed_here = (self.iteration if self.iteration and a.load and a.save and
                             os.path.realpath(a.load) == os.path.realpath(a.save) else None)
        self.last_saved = None
        self.counters = {"consumed_train_samples": 0, "consumed_valid_samples": 0,
                         "skipped": 0, "nan": 0, "num_floating_point_operations_so_far": 0,
                         **counters}
        self.vocab_size = vocab
        # Collective (megatron-core's builder has barriers); None where no data is read.
        train, valid, test = build_datasets(a, tokenizer)
        self.train_iter = self._micro_batches(train, self.counters["consumed_train_samples"],
                                              "train")
        # --skip-train reads validation from its first sample, as Megatron-LM's loaders do.
        self.valid_iter = self._micro_batches(valid, 0 if a.skip_train else self.counters[
            "consumed_valid_samples"], "valid")
        self.test_ds = test
        self.steps = wiring.steps(a, self.registry, tokenizer.eod,
                                  getattr(tokenizer, "pad", None), a.plan_ahead)
        self.fwd_bwd = schedules.get_forward_backward_func()
        self.reporter = Reporter(a, dist.get_rank() == dist.get_world_size() - 1, vocab)
        self.controls = controls

    def _micro_batches(self, dataset, consumed, name):
        """This DP rank's micro-batches of `dataset` from sample `consumed` (None where no data
        is read); with virtual pipeline stages one stream per model chunk, as Megatron-LM's:
        each chunk's attention needs every micro-batch's plan."""
        if dataset is None:
            return None
        streams = [MicroBatches(dataset, self.args.micro_batch_size,
                                self.ps.get_data_parallel_rank(), self.args.data_parallel_size,
                                consumed, name, cyclic=name != "train",
                                num_workers=self.args.num_workers)
                   for _ in self.chunks]
        return streams[0] if len(streams) == 1 else streams

    def _each(self, method, *args, **kwargs):
        """Call `method` on every model chunk."""
        for chunk in self.chunks:
            getattr(chunk, method)(*args, **kwargs)

    def _schedule(self, data_iterator, forward_only, num_micro_batches):
        a = self.args
        if data_iterator is None and len(self.chunks) > 1:  # a rank that reads no data:
            data_iterator = [None] * len(self.chunks)  # the interleaved schedule wants a list
        return self.fwd_bwd(forward_step_func=self.steps.forward_step,
                            data_iterator=data_iterator, model=self.chunks,
                            num_microbatches=num_micro_batches,
                            seq_length=a.micro_batch_size * a.seq_length, micro_batch_size=1,
                            forward_only=forward_only)

    def _mean_loss(self, outputs):
        """Token-weighted mean over micro-batches and DP x CP ranks (last stage), else nan."""
        if not self.ps.is_pipeline_last_stage():
            return float("nan")
        total = torch.zeros(2, dtype=torch.float64)
        for out in outputs:
            total += out["lm loss"].detach().double().cpu()
        total = total.to(self.device)
        dist.all_reduce(total, group=self.ps.get_data_parallel_group(with_context_parallel=True))
        return (total[0] / total[1].clamp(min=1)).item()

    def _train_step(self):
        """-> (loss, grad norm or None, lr, attention pairs, plan wait, samples consumed,
        {params_norm, num_zeros} as asked)."""
        a = self.args
        self.calculator.update_num_microbatches(self.counters["consumed_train_samples"],
                                                consistency_check=True)
        micro_batches = self.calculator.get_num_microbatches()
        samples = micro_batches * a.micro_batch_size * a.data_parallel_size
        self._each("zero_grad_buffer")
        self.optimizer.zero_grad()
        self.steps.pairs_seen = 0
        waited = self.steps.plan_wait_s
        lr = self.optimizer.param_groups[0]["lr"]
        loss = self._mean_loss(self._schedule(self.train_iter, False, micro_batches))
        self.controls.after_forward_backward()
        updated, grad_norm, num_zeros = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=samples)
        else:
            self.counters["skipped"] += 1
        if a.log_params_norm and self.gathers_params:  # this step's weights on every rank
            self._each("start_param_sync", force_sync=True)
        logged = {"num_zeros": num_zeros if a.log_num_zeros_in_grad else None,
                  "params_norm": params_norm(self.chunks) if a.log_params_norm else None}
        pairs = torch.tensor([float(self.steps.pairs_seen)], dtype=torch.float64,
                             device=self.device)
        dist.all_reduce(pairs, group=self.ps.get_data_parallel_group())
        self._stop_if_not_finite(f"iteration {self.iteration + 1}", loss, grad_norm, updated)
        return (loss, grad_norm, lr, pairs.item(), self.steps.plan_wait_s - waited, samples,
                logged)

    def _stop_if_not_finite(self, where, loss, grad_norm=None, updated=False):
        """NaN/Inf in the loss (training or evaluation, as Megatron-LM's loss checks) or the
        grad norm stops every rank (the loss is known on the last pipeline stage only, so the
        verdict is reduced over the world); an fp16 step the loss scaler skipped is a skip,
        not a stop."""
        if not self.args.check_for_nan_in_loss_and_grad:
            return
        last = self.ps.is_pipeline_last_stage()
        bad = torch.tensor([float(last and not math.isfinite(loss)),
                            float(updated and not _finite(grad_norm))],
                           device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.any():
            what = " and ".join(name for name, b in zip(("lm loss", "grad norm"), bad.tolist())
                                if b)
            raise NonFiniteError(
                f"{where}: {what} is NaN or Inf (lm loss {loss}, grad norm {grad_norm}); "
                f"stopping. Lower --lr, check the data, or pass "
                f"--no-check-for-nan-in-loss-and-grad to keep going")

    def evaluate(self, label="validation", in_loop=False):
        """`in_loop`: an evaluation between iterations (--manual-gc collects around those)."""
        a = self.args
        if a.eval_iters == 0:
            return
        if label == "validation":
            iterator = self.valid_iter
        else:
            iterator = self._micro_batches(self.test_ds, 0, "test")
        if not self._split_has_samples(iterator):
            return  # the split has no samples (e.g. --split 100,0,0)
        hooks_were_on = self.hooks_on
        self._param_hooks(False)
        self._each("eval")
        outputs = []
        # the full --global-batch-size, as Megatron-LM evaluates
        with torch.no_grad(), (self.controls.around_evaluation() if in_loop
                               else contextlib.nullcontext()):
            for _ in range(a.eval_iters):
                outputs += self._schedule(iterator, True, a.num_micro_batches)
                self.controls.after_forward_backward()
        self._each("train")
        self._param_hooks(hooks_were_on)
        if label == "validation":
            self.counters["consumed_valid_samples"] += a.eval_iters * a.global_batch_size
        loss = self._mean_loss(outputs)
        self.reporter.validation(self.iteration, loss, label, in_loop)
        self._stop_if_not_finite(f"{label} at iteration {self.iteration}", loss)

    def _split_has_samples(self, iterator) -> bool:
        """Decided where data is read (TP rank 0) and shared with the whole TP group, whose
        other ranks hold no iterator: all of them evaluate or none does."""
        has = torch.tensor([0 if iterator is None and is_dataset_built_on_rank() else 1],
                           device=self.device)
        if self.ps.get_tensor_model_parallel_world_size() > 1:
            dist.broadcast(has, src=self.ps.get_tensor_model_parallel_src_rank(),
                           group=self.ps.get_tensor_model_parallel_group())
        return bool(has.item())

    def _param_hooks(self, enable: bool, sync: bool = True):
        """--overlap-param-gather: the forward pre-hooks that wait for the distributed
        optimizer's parameter all-gather (disabling them gathers now unless sync is False)."""
        if not self.gathers_params:
            return
        if enable and not self.hooks_on:
            self._each("enable_forward_pre_hook")
        elif not enable and self.hooks_on:
            self._each("disable_forward_pre_hook", param_sync=False)
        if not enable and sync:
            self._each("start_param_sync", force_sync=True)
        self.hooks_on = enable

    def _save(self, before_evaluation=False):
        """`before_evaluation`: the last iteration, saved before its evaluation in the loop
        (a NaN there stops the run and must not lose it); the checkpoint counts that
        evaluation's batches, as Megatron-LM's, saved after it, does, so a longer resumed
        run reads the next validation batch, as the uninterrupted run does."""
        if self.iteration in (self.resumed_here, self.last_saved):
            return
        self.last_saved = self.iteration
        if self.gathers_params:  # the saved weights must be this step's
            self._each("start_param_sync", force_sync=True)
        counters = dict(self.counters)
        if before_evaluation:
            counters["consumed_valid_samples"] += self.args.eval_iters * \
                self.args.global_batch_size
        save_checkpoint(self.args, self.iteration, self.chunks, self.optimizer, self.scheduler,
                        counters)

    def run(self):
        a, counters = self.args, self.counters
        self._each("train")
        losses = []
        # Megatron-LM: the first iteration runs without the gather hooks, so that a bad load
        # or init does not spread through the first all-gather.
        self._param_hooks(False, sync=False)
        micro_batches = self._micro_batches_now()
        if a.skip_train:  # as Megatron-LM: evaluate the loaded weights, then stop
            if dist.get_rank() == 0:
                print("skipping training (--skip-train is on) ...", flush=True)
            self.evaluate()
            self.evaluate("test")
            return self._finish(losses)
        self.controls.begin_training()
        while self.iteration < a.train_iters:
            # Megatron-LM: a checkpoint whenever the batch ramp-up changes the micro-batch
            # count, so a restart resumes at a consistent batch size.
            now = self._micro_batches_now()
            if now != micro_batches and self.iteration and a.save:
                self._save()
            micro_batches = now
            start = time.perf_counter()
            loss, grad_norm, lr, pairs, plan_wait, samples, logged = self._train_step()
            self._param_hooks(True)
            self.iteration += 1
            self.controls.after_step(self.iteration)
            counters["consumed_train_samples"] += samples
            counters["num_floating_point_operations_so_far"] += model_flops(
                a, self.vocab_size, samples * a.seq_length, pairs)  # saved (EoD pairs only)
            if (self.ps.is_pipeline_last_stage() and not math.isfinite(loss)) or \
                    not _finite(grad_norm):
                counters["nan"] += 1  # with --no-check-for-nan-in-loss-and-grad
            losses.append(loss)
            self.reporter.iteration(self.iteration, time.perf_counter() - start, lr, loss,
                                    grad_norm, counters["skipped"], counters["nan"],
                                    counters["consumed_train_samples"], pairs, plan_wait,
                                    samples, **logged)
            if a.eval_interval and self.iteration % a.eval_interval == 0:  # the last one
                if self.iteration == a.train_iters and a.save:  # too, as Megatron-LM (then
                    self._save(before_evaluation=True)  # again at the end), saved first
                self.evaluate(in_loop=True)
            saved = a.save and a.save_interval and self.iteration % a.save_interval == 0
            if saved:
                self._save()
            if (a.exit_interval and self.iteration % a.exit_interval == 0) or \
                    self._told_to_exit():
                if a.save and not saved:
                    self._save()
                return self._finish(losses)
        # Saved before the last evaluations, as Megatron-LM's pretrain() does: a NaN there
        # stops the run (NonFiniteError) but must not lose the iterations since the last save.
        if a.save and not (a.save_interval and self.iteration % a.save_interval == 0):
            self._save()
        self.evaluate()
        self.evaluate("test")
        return self._finish(losses)

    def _told_to_exit(self) -> bool:
        """--exit-duration-in-mins reached, or --exit-signal received (--exit-signal-handler),
        on any rank: every rank then stops here. One all-reduce for both."""
        a = self.args
        limit = a.exit_duration_in_mins
        if not (limit or a.exit_signal_handler):
            return False
        minutes = (_now() - self.started) / 60
        told = torch.tensor([int(bool(limit) and minutes > limit),
                             int(self.controls.signal_received())], device=self.device)
        dist.all_reduce(told, op=dist.ReduceOp.MAX)
        late, signalled = told.tolist()
        if dist.get_rank() == 0 and (late or signalled):
            print(f" exiting after {minutes:.1f} minutes (--exit-duration-in-mins {limit})"
                  if late else f" exiting after receiving {a.exit_signal} "
                               f"(--exit-signal-handler)", flush=True)
        return bool(late or signalled)

    def _micro_batches_now(self) -> int:
        self.calculator.update_num_microbatches(self.counters["consumed_train_samples"],
                                                consistency_check=False)
        return self.calculator.get_num_microbatches()

    def _finish(self, losses):
        self.reporter.close()
        self.steps.close()
        return losses


def _finite(grad_norm) -> bool:
    """A grad norm is None when --clip-grad 0 (megatron-core computes none)."""
    return grad_norm is None or math.isfinite(grad_norm)
