#!/usr/bin/env python3
"""End to end: pretrain_gpt.py tokens/s with EoD reset against the same model with plain causal
attention, on a web-like document mix.

    python tools/bench_e2e.py [--preset 1b] [--seq-length 32768] [--iters 12] [--warmup 4]
                              [--nproc 1] [--work-dir runs/bench_e2e] [-- EXTRA FLAGS]

1. Writes a synthetic corpus whose document lengths follow the web mix of tools/bench_cp.py
   (lognormal, median 600 tokens, sigma 1.0; random ASCII, byte tokens) and preprocesses it
   (tools/preprocess_data.py's code, EoD appended) into an indexed dataset, once.
2. Trains the preset twice with torchrun through pretrain_gpt.py (Megatron-LM's trainer),
   --metrics-file on:
     eod     --reset-attention-mask --reset-position-ids --eod-mask-loss
     causal  the same model and data, attention across documents (plain causal rows)
3. Prints, from the iterations after --warmup: median tokens/s per GPU, model TFLOP/s per GPU
   (Megatron-LM's own FLOPs formula, counting the pairs each run computes: a causal row's
   s^2, a document mask's sum of n^2: the "EoD-adjusted" figure, which --metrics-file's
   tflops_per_gpu holds), the query-key pairs per row, and the speed-up eod/causal.

Presets: `1b` (examples/gpu/gpt_flags.sh's ~1.2B Llama-like GPT, bf16, full recompute of every
layer so 32k tokens fit one 80 GB GPU), `tiny` (2 layers, float32: a CPU smoke run, gloo).
Without TransformerEngine or Apex, Megatron-LM's local layers and no gradient-accumulation
fusion. Extra
flags after `--` go to both runs (Megatron spellings), e.g. `-- --recompute-num-layers 2`.
Needs a GPU for the 1b preset; the numbers go to docs/BENCHMARKS.md.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

PRESETS = {
    "1b": dict(layers=24, hidden=2048, ffn=5632, heads=16, groups=8, swiglu=True, bf16=True,
               flags=["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                      "--untie-embeddings-and-output-weights", "--rotary-base", "500000",
                      "--bf16", "--recompute-granularity", "full", "--recompute-method",
                      "uniform", "--recompute-num-layers", "1"]),
    "tiny": dict(layers=2, hidden=64, ffn=256, heads=4, groups=2, swiglu=False, bf16=False,
                 flags=[]),
}


def write_web_corpus(path, tokens, seed=0):
    """jsonl documents with web-mix lengths (bytes = byte tokens), `tokens` in total."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ,.\n", dtype=np.uint8)
    written = 0
    with open(path, "w") as f:
        while written < tokens:
            n = max(1, int(rng.lognormal(math.log(600), 1.0)))
            text = alphabet[rng.integers(0, alphabet.size, n)].tobytes().decode()
            f.write(json.dumps({"text": text}) + "\n")
            written += n + 1


def build_dataset(work_dir, tokens):
    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.tokenizers import ByteTokenizer

    prefix = os.path.join(work_dir, "web")
    if not os.path.exists(prefix + "_text_document.idx"):
        corpus = os.path.join(work_dir, "web.jsonl")
        write_web_corpus(corpus, tokens)
        preprocess_jsonl(corpus, prefix, ByteTokenizer(), append_eod=True, workers=2)
    return prefix + "_text_document"


def model_flags(preset, seq):
    p = PRESETS[preset]
    return ["--num-layers", str(p["layers"]), "--hidden-size", str(p["hidden"]),
            "--ffn-hidden-size", str(p["ffn"]), "--num-attention-heads", str(p["heads"]),
            "--group-query-attention", "--num-query-groups", str(p["groups"]),
            "--position-embedding-type", "rope",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--attention-dropout", "0", "--hidden-dropout", "0", *p["flags"]]


def device_flags(preset):
    """What this machine runs: bf16 on a GPU for `1b`, else float32 on gloo (CPU ranks); the
    local layers without TransformerEngine, no gradient-accumulation fusion without Apex."""
    import importlib.util

    import torch

    flags = [] if torch.cuda.is_available() else ["--distributed-backend", "gloo"]
    if importlib.util.find_spec("transformer_engine") is None:
        flags += ["--transformer-impl", "local"]
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        flags += ["--no-gradient-accumulation-fusion"]
    return flags


def run(name, args, data, extra):
    metrics = os.path.join(args.work_dir, f"metrics_{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    eod = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"] \
        if name == "eod" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc), os.path.join(REPO, "pretrain_gpt.py"),
           *model_flags(args.preset, args.seq_length), *device_flags(args.preset),
           "--micro-batch-size", "1", "--global-batch-size", str(args.nproc),
           "--train-iters", str(args.iters), "--lr", "1e-4", "--lr-warmup-iters", "0",
           "--data-path", data, "--split", "100,0,0", "--eval-iters", "0", "--num-workers", "0",
           "--log-interval", str(args.iters), "--metrics-file", metrics, *eod, *extra]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1")
    log = os.path.join(args.work_dir, f"log_{name}.txt")
    with open(log, "w") as out:
        if subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env) != 0:
            sys.exit(f"bench_e2e: the {name} run failed; see {log}")
    with open(metrics) as f:
        return [json.loads(line) for line in f if '"kind"' not in line]


def summarise(name, records, args):
    kept = [r for r in records if r["iteration"] > args.warmup] or records
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in kept) / args.nproc
    rows = kept[0]["tokens"] // args.seq_length
    # Megatron-LM's FLOPs count (tflops_per_gpu) and the pairs each row's attention computes:
    # the sum over its documents of n(n+1)/2, from the records' sum of n^2 and tokens.
    pairs = statistics.median((r["seqlen_squared_sum"] + r["tokens"]) / 2 for r in kept)
    return {"run": name, "tokens_per_s_per_gpu": tokens_per_s,
            "model_tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in kept),
            "pairs_per_row": pairs / max(1, rows)}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--seq-length", type=int, default=32768)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench_e2e"))
    args = p.parse_args(argv)
    for flag in ("seq_length", "iters", "nproc"):  # (each failed inside torchrun before)
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.warmup >= args.iters:
        p.error(f"--warmup {args.warmup} must be below --iters {args.iters}")
    os.makedirs(args.work_dir, exist_ok=True)
    data = build_dataset(args.work_dir, (args.iters + 2) * args.nproc * args.seq_length * 2)
    rows = [summarise(name, run(name, args, data, extra), args) for name in ("causal", "eod")]
    print(f"{'run':8s} {'tokens/s/GPU':>14s} {'model TFLOP/s/GPU':>18s} {'pairs/row':>12s}")
    for r in rows:
        print(f"{r['run']:8s} {r['tokens_per_s_per_gpu']:14.1f} {r['model_tflops_per_gpu']:18.2f}"
              f" {r['pairs_per_row']:12.3g}")
    speedup = rows[1]["tokens_per_s_per_gpu"] / rows[0]["tokens_per_s_per_gpu"]
    print(f"EoD reset / causal tokens/s: {speedup:.2f}x "
          f"(preset {args.preset}, {args.seq_length} tokens, {args.nproc} GPU(s))")
    return rows


if __name__ == "__main__":
    main()
