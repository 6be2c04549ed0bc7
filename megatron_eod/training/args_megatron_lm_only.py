"""Megatron-LM's flags the lean trainer does not implement, each with its reason.

One job: let a Megatron-LM launch script's flags mean something under the lean trainer
(`pretrain_gpt.py` where megatron.training is absent) instead of "unrecognized". Every flag
of Megatron-LM's own parser (core_v0.16.1; tests/training/test_args_megatron_lm_only.py
checks the whole parser) is one of:

- a lean trainer flag (args.py, args_optim.py): honoured;
- in NO_EFFECT (or NO_EFFECT_HERE, for the runs where a lean flag changes nothing):
  accepted, because what it asks is already so here or it only tunes a kernel,
  a report or a service the lean trainer does not have; the run says once, on rank 0, which
  of them it was given and why they change nothing (`no_effect_notice`);
- in a family of ABSENT: refused, naming the flag and the feature, and Megatron-LM's own
  trainer that runs it (--trainer megatron-lm), or, where EoD attention cannot run it in
  either trainer, megatron_lm_args.REFUSED's reason.

Flags Megatron-LM itself removed (REMOVED: its trainer refuses them too) name their
replacement. A flag that is neither the lean trainer's nor Megatron-LM's is refused with the
nearest lean flag (`explain_unrecognized`), also where it starts like a family
(--ddp-bucket-sizes is --ddp-bucket-size's typo, not a DDP option the lean trainer lacks).

What it does not do: no flag here changes a run. A flag that changes the model, the data or
the optimizer's numbers never goes in NO_EFFECT: it is honoured or refused.
"""

from __future__ import annotations

import difflib
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.megatron_lm_args import REFUSED

__all__ = ["ABSENT", "NO_EFFECT", "NO_EFFECT_HERE", "REMOVED", "add_no_effect_args", "check_no_effect_values",
           "explain_unrecognized", "no_effect_notice", "why_absent"]

_KERNEL = "the attention kernels here compute the softmax in float32 always"
_EOD_KERNELS = ("attention runs in megatron-eod's kernels (varlen flash attention on GPUs, "
                "torch's flash kernel on CPU), EoD or causal")
_REPORT = ("a report the lean trainer does not write (its log line, --metrics-file and "
           "--tensorboard-dir hold loss, grad norm, LR, tokens/s, attention TFLOP/s, with "
           "--log-params-norm, --log-num-zeros-in-grad, --log-throughput)")
_SERVICE = "a service of Megatron-LM's trainer the lean trainer does not start"
_CKPT_SPEED = ("it only tunes how a torch_dist checkpoint is written or read; saves here are "
               "synchronous: a save has finished when training goes on")

# flag -> (number of values: 0 a switch, 1 one value, "+" several; why it changes nothing)
NO_EFFECT: Dict[str, Tuple[object, str]] = {
    "--use-mcore-models": (0, "megatron-core's GPTModel is the only model here (the flag is "
                              "deprecated in Megatron-LM too)"),
    "--calculate-per-token-loss": (0, "the loss is always per token here: one token-weighted "
                                      "mean over micro-batches, DP and CP ranks"),
    "--accumulate-allreduce-grads-in-fp32": (0, "gradients are accumulated and reduced in "
                                                "float32 here unless --grad-reduce-in-bf16, "
                                                "which wins, as in Megatron-LM"),
    "--attention-backend": (1, _EOD_KERNELS),
    "--attention-softmax-in-fp32": (0, _KERNEL),
    "--apply-query-key-layer-scaling": (0, _KERNEL + " (the scaling only guards fp16 "
                                           "softmax in unfused attention)"),
    "--no-masked-softmax-fusion": (0, _EOD_KERNELS + " (no masked softmax)"),
    "--no-rope-fusion": (0, "RoPE is applied inside megatron-eod's attention, at the reset "
                            "positions, unfused"),
    "--no-persist-layer-norm": (0, "the persistent layer-norm kernel (apex) is never used here"),
    "--no-async-tensor-model-parallel-allreduce": (0, "deprecated in Megatron-LM: no effect "
                                                      "there either"),
    "--openai-gelu": (0, "read by Megatron-LM's legacy models only: no effect on "
                         "megatron-core's GPTModel there either"),
    "--apply-residual-connection-post-layernorm": (0, "megatron-core 0.16's layers do not "
                                                      "read it: no effect in Megatron-LM's "
                                                      "GPT either"),
    "--disable-jit-fuser": (0, "megatron-core applies its jit fuser to its fused functions "
                               "when they are imported, before any flag is read"),
    "--tokenizer-hf-use-fast": (0, "training reads token ids from the dataset; the tokenizer "
                                   "gives only EoD, pad and the vocabulary size, the same "
                                   "fast or slow"),
    "--tokenizer-hf-include-special-tokens": (0, "training never tokenizes text"),
    "--async-save": (0, _CKPT_SPEED),
    "--ckpt-fully-parallel-save": (0, _CKPT_SPEED),
    "--no-ckpt-fully-parallel-save": (0, _CKPT_SPEED),
    "--ckpt-fully-parallel-load": (0, _CKPT_SPEED),
    "--ckpt-assume-constant-structure": (0, _CKPT_SPEED),
    "--use-persistent-ckpt-worker": (0, _CKPT_SPEED),
    "--timing-log-level": (1, _REPORT),
    "--timing-log-option": (1, _REPORT),
    "--no-barrier-with-level-1-timing": (0, _REPORT),
    "--log-timers-to-tensorboard": (0, _REPORT),
    "--log-memory-to-tensorboard": (0, _REPORT),
    "--log-world-size-to-tensorboard": (0, _REPORT),
    "--no-log-loss-scale-to-tensorboard": (0, _REPORT),
    "--tensorboard-log-interval": (1, _REPORT),
    "--tensorboard-queue-size": (1, _REPORT),
    "--log-memory-interval": (1, _REPORT),
    "--log-device-memory-used": (0, _REPORT),
    "--log-energy": (0, _REPORT),
    "--log-progress": (0, _REPORT),
    "--logging-level": (1, _REPORT),
    "--log-straggler": (0, _REPORT),
    "--straggler-ctrlr-port": (1, _REPORT),
    "--straggler-minmax-count": (1, _REPORT),
    "--disable-straggler-on-startup": (0, _REPORT),
    "--no-one-logger": (0, _SERVICE),
    "--one-logger-project": (1, _SERVICE),
    "--one-logger-run-name": (1, _SERVICE),
    "--one-logger-async": (0, _SERVICE),
    "--app-tag-run-name": (1, _SERVICE),
    "--app-tag-run-version": (1, _SERVICE),
    "--disable-msc": (0, _SERVICE + " (Multi-Storage Client: paths here are local files)"),
    "--disable-gloo-process-groups": (0, "the lean trainer makes gloo groups only for the "
                                         "distributed optimizer's --ckpt-format torch state, "
                                         "and refuses the flag there"),
    "--local-rank": (1, "torchrun's LOCAL_RANK environment variable is read instead"),
    "--rerun-mode": (1, "only 'disabled' is accepted: the lean trainer has no rerun engine"),
}

# Megatron-LM's second spellings of no-effect flags.
_ALIASES = {
    "--no-async-tensor-model-parallel-allreduce": "--disable-async-tensor-model-parallel-allreduce",
    "--no-ckpt-fully-parallel-save": "--disable-ckpt-fully-parallel-save",
    "--no-log-loss-scale-to-tensorboard": "--disable-log-loss-scale-to-tensorboard",
}

# Megatron-LM's values for the no-effect flags that take one: a typo is still an error.
_CHOICES = {
    "--attention-backend": ("flash", "fused", "unfused", "local", "auto"),
    "--timing-log-level": ("0", "1", "2"),
    "--timing-log-option": ("max", "minmax", "all"),
}

# Megatron-LM's value types for them.
_TYPES = {flag: int for flag in (
    "--local-rank", "--logging-level", "--tensorboard-log-interval", "--tensorboard-queue-size",
    "--log-memory-interval", "--straggler-ctrlr-port", "--straggler-minmax-count")}

# Flags Megatron-LM removed (its trainer refuses them too) -> what to pass instead.
REMOVED = {
    "--checkpoint-activations": "--recompute-activations (or --recompute-granularity)",
    "--batch-size": "--micro-batch-size",
    "--warmup": "--lr-warmup-fraction or --lr-warmup-iters",
    "--model-parallel-size": "--tensor-model-parallel-size",
}

_MEGATRON_LM = ("Megatron-LM's own trainer runs it: --trainer megatron-lm where "
                "megatron.training is installed (megatron-core >= 0.17 wheels, or a "
                "Megatron-LM checkout on PYTHONPATH)")

# (feature, flag prefixes, whole flags); the first family that matches names the feature.
ABSENT: List[Tuple[str, Tuple[str, ...], Tuple[str, ...]]] = [
    ("mixture of experts", ("--moe-", "--expert-", "--num-experts"),
     ("--overlap-moe-expert-parallel-comm", "--ep-overlap-early-attn-memory-release")),
    ("multi-latent attention", (),
     ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
      "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor", "--mscale",
      "--mscale-all-dim", "--cache-mla-latents")),
    ("multi-token prediction", ("--mtp-",), ()),
    ("FP8/FP4 training and TransformerEngine's precision options",
     ("--fp8-", "--fp4-", "--no-fp8-", "--te-"),
     ("--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
      "--num-layers-at-end-in-bf16", "--reuse-grad-buf-for-mxfp8-param-ag",
      "--keep-fp8-transpose-cache", "--use-te-activation-func", "--fp16-lm-cross-entropy",
      "--disable-bf16-reduced-precision-matmul", "--fp32-residual-connection")),
    ("tensor-parallel communication overlap (TransformerEngine userbuffers)",
     ("--tp-comm-", "--no-tp-comm-", "--disable-tp-comm-"), ()),
    ("another model than dense GPT with softmax attention",
     ("--dsa-", "--linear-", "--kitchen-", "--mamba-", "--hybrid-", "--relative-attention-",
      "--heterogeneous-layers-config-"),
     ("--experimental-attention-variant", "--window-size", "--window-attn-skip-freq",
      "--softmax-type", "--qk-l2-norm", "--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold",
      "--attention-output-gate", "--use-kitchen-attention", "--is-hybrid-model", "--spec",
      "--yaml-cfg", "--mrope-section", "--quick-geglu", "--glu-linear-offset",
      "--activation-func-clamp-value", "--use-fused-weighted-squared-relu", "--no-rope-freq",
      "--rope-type", "--use-legacy-models", "--enable-experimental", "--encoder-num-layers",
      "--decoder-num-layers", "--decoder-seq-length", "--disable-mamba-mem-eff-path",
      "--onnx-safe", "--no-initialization", "--init-model-with-meta-device")),
    ("reinforcement learning, inference and fine-tuning",
     ("--rl-", "--grpo-", "--langrl-", "--inference-", "--sft", "--no-rl-", "--no-langrl-",
      "--no-inference-"),
     ("--perform-rl-step", "--refit-method", "--max-tokens-to-oom", "--flash-decode",
      "--decode-only-cuda-graphs", "--enable-chunked-prefill", "--disable-chunked-prefill",
      "--nccl-all-reduce-for-prefill", "--mlp-chunks-for-prefill", "--use-legacy-static-engine",
      "--output-bert-embeddings", "--bert-embedder-type", "--symmetric-ar-type",
      "--batch-invariant-mode")),
    ("another model family (BERT, T5, retrieval, vision)",
     ("--ict-", "--biencoder-", "--bert-", "--retriever-", "--indexer-", "--vision-", "--swin-",
      "--dino-", "--img-"),
     ("--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs",
      "--evidence-data-path", "--block-data-path", "--embedding-path", "--num-classes",
      "--num-channels", "--patch-dim", "--classes-fraction", "--data-per-class-fraction",
      "--no-data-sharding", "--head-lr-mult", "--mask-type", "--mask-factor", "--iter-per-epoch",
      "--mask-prob", "--short-seq-prob", "--vocab-extra-ids", "--sample-rate")),
    ("fully sharded data parallelism (Megatron FSDP, torch FSDP2): the lean trainer shards "
     "the optimizer with --use-distributed-optimizer",
     ("--fsdp-", "--torch-fsdp2-"),
     ("--use-megatron-fsdp", "--use-torch-fsdp2", "--data-parallel-sharding-strategy",
      "--outer-dp-sharding-strategy", "--suggested-communication-unit-size",
      "--enable-full-sharding-in-hsdp", "--num-distributed-optimizer-instances",
      "--no-strict-fsdp-dtensor-load")),
    ("pipeline layouts and pipeline communication options: the lean trainer splits "
     "--num-layers over the stages by --decoder-first/last-pipeline-num-layers and "
     "--account-for-embedding/loss-in-pipeline-split",
     (),
     ("--pipeline-model-parallel-layout",
      "--pipeline-model-parallel-comm-backend", "--use-ring-exchange-p2p",
      "--no-scatter-gather-tensors-in-pipeline", "--defer-embedding-wgrad-compute",
      "--wgrad-deferral-limit", "--delay-wgrad-compute")),
    ("optimizer and gradient-reduction options beyond megatron-core's Adam/SGD with float32 "
     "gradients and --use-distributed-optimizer",
     ("--muon-", "--ddp-"),
     ("--optimizer-cpu-offload", "--optimizer-offload-fraction",
      "--use-torch-optimizer-for-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
      "--no-pin-cpu-grads", "--no-pin-cpu-params", "--use-precision-aware-optimizer",
      "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype",
      "--decoupled-lr", "--decoupled-min-lr", "--apply-wd-to-qk-layernorm",
      "--no-weight-decay-cond-type", "--dump-param-to-param-group-map",
      "--overlap-param-gather-with-optimizer-step", "--no-align-param-gather",
      "--no-gradient-reduce-div-fusion", "--data-parallel-random-init")),
    ("checkpoint options beyond --save, --load, --save-interval, --save-keep-last, "
     "--pretrained-checkpoint, --finetune and the --no-load-*/--no-save-* switches",
     ("--non-persistent-", "--ckpt-convert-", "--replication", "--dist-ckpt-"),
     ("--persistent-save-interval", "--save-wgrads-interval", "--save-dgrads-interval",
      "--save-retain-interval", "--load-main-params-from-ckpt", "--ckpt-step",
      "--distrib-optim-fully-reshardable-mem-efficient")),
    ("report of the largest attention logits", (), ("--log-max-attention-logit",)),
    ("fault tolerance, restarts and result checking",
     ("--inprocess-", "--error-injection-", "--adlr-autoresume", "--ft-"),
     ("--enable-ft-package", "--calc-ft-timeouts", "--check-for-spiky-loss",
      "--check-for-large-grads", "--result-rejected-tracker-filename", "--iterations-to-skip",
      "--run-workload-inspector-server", "--check-weight-hash-across-dp-replicas-interval",
      "--train-sync-interval", "--exit-signal-handler-for-dataloader")),
    ("profiling and Weights & Biases: the lean trainer writes its log, --metrics-file and "
     "--tensorboard-dir", ("--wandb-", "--profile"),
     ("--use-pytorch-profiler", "--record-memory-history", "--memory-snapshot-path",
      "--config-logger-dir")),
    ("CUDA graphs, activation offloading and communication tuning",
     ("--cuda-graph-",),
     ("--enable-cuda-graph", "--external-cuda-graph", "--cpu-offloading-num-layers",
      "--fine-grained-activation-offloading", "--offload-modules", "--min-offloaded-tensor-size",
      "--recompute-modules", "--distribute-saved-activations", "--high-priority-stream-groups",
      "--use-nccl-ub", "--disable-symmetric-registration", "--use-sharp",
      "--sharp-enabled-group", "--create-all-gather-group", "--nccl-communicator-config-path",
      "--fake-process-group", "--lazy-mpu-init",
      "--distributed-timeout-seconds-after-init", "--no-clone-scatter-output-in-embedding")),
    ("dynamic context parallelism (a CP size per sequence): the lean trainer splits every "
     "row over --context-parallel-size ranks, --context-parallel-algo ring|ulysses|hybrid or "
     "--cp-comm-type p2p|a2a|a2a+p2p",
     (), ("--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank")),
    ("data and validation options beyond one blend or a blend per split",
     ("--fim-",),
     ("--fim-data", "--phase-transition-iterations", "--per-dataset-sequences-path",
      "--allow-ambiguous-pad-tokens", "--object-storage-cache-path", "--multiple-validation-sets",
      "--full-validation", "--test-mode")),
    ("tokenizer options beyond megatron-core's tokenizers as --tokenizer-type builds them",
     (), ("--legacy-tokenizer", "--tokenizer-sentencepiece-legacy", "--tokenizer-special-tokens",
          "--tokenizer-metadata", "--padded-vocab-size", "--trust-remote-code")),
]

# megatron_lm_args.REFUSED, by flag: what EoD attention runs in neither trainer.
_NEITHER = {"--" + dest.replace("_", "-"): why for dest, (_, why) in REFUSED.items()}
_NEITHER["--moe-"] = _NEITHER["--num-experts"]
_NEITHER["--mtp-"] = _NEITHER["--mtp-num-layers"]


def add_no_effect_args(parser) -> None:
    g = parser.add_argument_group("Megatron-LM flags with no effect here (said at start-up)")
    for flag, (values, why) in NO_EFFECT.items():
        spellings = (flag, _ALIASES[flag]) if flag in _ALIASES else (flag,)
        if values == 0:
            g.add_argument(*spellings, action="store_true", help=why)
        else:
            g.add_argument(*spellings, nargs=None if values == 1 else "+", default=None, help=why,
                           choices=_CHOICES.get(flag), type=_TYPES.get(flag))


def check_no_effect_values(args) -> None:
    """--rerun-mode: Megatron-LM's other modes re-run steps to check results; refused."""
    mode = getattr(args, "rerun_mode", None)
    if mode not in (None, "disabled"):
        raise FlagError(f"--rerun-mode {mode}: Megatron-LM's rerun engine, not in the lean "
                        f"trainer; pass --rerun-mode disabled, or {_MEGATRON_LM}")


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


# Lean flags that change nothing in some runs, as in Megatron-LM's, which accepts them there:
# flag -> (whether it changes nothing in this run, why).
NO_EFFECT_HERE = {
    "--dist-ckpt-optim-fully-reshardable": (
        lambda args: not args.use_distributed_optimizer,
        "it shapes the distributed optimizer's checkpoint; without --use-distributed-optimizer "
        "the optimizer's state reshards always"),
}


def no_effect_notice(args) -> Optional[str]:
    """The line rank 0 prints: each no-effect flag given, and why; None when none was."""
    given = [(flag, why) for flag, (_, why) in NO_EFFECT.items()
             if getattr(args, _dest(flag), None) not in (None, False)]
    given += [(flag, why) for flag, (idle, why) in NO_EFFECT_HERE.items()
              if getattr(args, _dest(flag), None) not in (None, False) and idle(args)]
    unlike = ("; --attention-dropout not given: 0 here, where Megatron-LM's default is 0.1 "
              "(the varlen attention kernels apply no dropout; Megatron-LM's trainer stops "
              "without --attention-dropout 0)"
              if getattr(args, "attention_dropout_defaulted", False) else "")
    if not given:
        return ("megatron-eod: " + unlike[2:]) if unlike else None
    reasons: Dict[str, List[str]] = {}
    for flag, why in given:
        reasons.setdefault(why, []).append(flag)
    return "megatron-eod: accepted, with no effect in the lean trainer: " + "; ".join(
        f"{', '.join(flags)} ({why})" for why, flags in reasons.items()) + unlike


def _family(flag: str):
    """(feature, matched by a prefix only) of the ABSENT family holding `flag`, or None; a
    family naming the flag itself before one whose prefix it merely has (--hybrid-context-
    parallel is dynamic CP, not one of the --hybrid-* models)."""
    named = [(feature, False) for feature, _, flags in ABSENT if flag in flags]
    return next(iter(named), None) or next(
        ((feature, True) for feature, prefixes, _ in ABSENT
         if any(flag.startswith(p) for p in prefixes)), None)


def why_absent(flag: str) -> Optional[str]:
    """Why the lean trainer refuses Megatron-LM's `flag`, or None when no family holds it."""
    if flag in REMOVED:
        return (f"{flag}: removed from Megatron-LM (its trainer refuses it too); pass "
                f"{REMOVED[flag]}")
    found = _family(flag)
    if found is None:
        if flag.startswith("--disable-"):  # Megatron-LM's second spelling of its --no-* flags
            spelled = "--no-" + flag[len("--disable-"):]
            why = why_absent(spelled)
            return None if why is None else flag + why[len(spelled):]
        return None
    name, _, note = found[0].partition(": ")
    neither = _NEITHER.get(flag) or next(
        (why for p, why in _NEITHER.items() if p.endswith("-") and flag.startswith(p)), None)
    if neither:
        return f"{flag}: Megatron-LM's {name}, refused by both trainers: {neither}"
    return (f"{flag}: Megatron-LM's {name}, which the lean trainer does not have"
            + (f" ({note})" if note else "") + f"; {_MEGATRON_LM}")


def explain_unrecognized(unknown: Sequence[str], known: Iterable[str]) -> str:
    """One message for parse_known_args' leftovers: the first flag among them, and why."""
    flags = [word.split("=", 1)[0] for word in unknown if word.startswith("--")]
    if not flags:
        return f"unrecognized arguments: {' '.join(unknown)}"
    flag = flags[0]
    near = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.75)
    reason = why_absent(flag)
    found = _family(flag)
    if found and found[1] and near and \
            difflib.SequenceMatcher(None, flag, near[0]).ratio() >= 0.9:
        reason = None  # a family's prefix, but a lean flag's typo (--ddp-bucket-sizes)
    if reason is None:
        reason = (f"unrecognized flag {flag}" + (f"; did you mean {near[0]}?" if near else "")
                  + " (the lean trainer's flags: --help; Megatron-LM's own trainer takes all "
                    "of Megatron-LM's: --trainer megatron-lm where megatron.training is "
                    "installed)")
    others = len(flags) - 1
    return reason + (f" [and {others} more unrecognized flag{'s' * (others > 1)}: "
                     f"{' '.join(flags[1:])}]" if others else "")
