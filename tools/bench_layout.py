#!/usr/bin/env python3
"""Benchmark the EoD layout and the preprocessing tool.

    python tools/bench_layout.py [--device cpu|cuda] [--repeats 20] [--corpus-bytes 8000000]

Prints, for one row of 131,072 tokens and for 8 rows of 32,768 (documents with lognormal
lengths, median ~600 tokens):
  * `build_doc_layout` time (median of repeats) and memory (CPU: all bytes torch allocates
    during one build, an upper bound of the peak; CUDA: max_memory_allocated);
  * beside it, what megatron-core's GPTDataset needs for the same batch: its dense bool mask
    (b*s*s bytes), the float32 tril it builds per sample first ("f32 tmp", 4*s*s bytes), and
    the time of its per-EoD Python loop with the dense mask switched off (its cheapest mode);
  * preprocessing throughput (MB/s of jsonl) of tools/preprocess_data.py with 1 and 2 workers
    on the offline sample corpus, with the byte tokenizer and with an 8k BPE (when the
    `tokenizers` package is installed).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402
import torch  # noqa: E402

from megatron_eod import build_doc_layout  # noqa: E402

EOD = 256
SHAPES = [(1, 131072), (8, 32768)]


def make_tokens(b, s, seed=0):
    rng = numpy.random.default_rng(seed)
    tokens = rng.integers(0, 256, size=b * s)
    pos = 0
    while True:
        pos += max(1, int(rng.lognormal(numpy.log(600), 1.0)))
        if pos > b * s:
            break
        tokens[pos - 1] = EOD
    return torch.from_numpy(tokens).view(b, s)


def time_layout(tokens, repeats, device):
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        layout = build_doc_layout(tokens, EOD, eod_mask_loss=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), layout


def allocated_cpu_bytes(tokens):
    """Total bytes torch allocates during one build (an upper bound of the peak)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        build_doc_layout(tokens, EOD, eod_mask_loss=True)
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events() if e.name != "[memory]")


def megatron_loop_seconds(tokens):
    """megatron-core's per-sample mask/position builder, dense mask OFF (its cheapest mode)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    start = time.perf_counter()
    for row in tokens:
        _get_ltor_masks_and_position_ids(row, EOD, True, True, True, False)
    return time.perf_counter() - start


def bench_layouts(device, repeats):
    print(f"== build_doc_layout on {device} (median of {repeats})")
    print(f"{'batch':>10} {'docs':>6} {'layout ms':>10} {'alloc MiB':>9} {'layout MiB':>11} "
          f"{'dense bool GiB':>15} {'f32 tmp GiB':>14} {'mcore loop ms':>14}")
    for b, s in SHAPES:
        tokens = make_tokens(b, s)
        if device == "cuda":
            tokens = tokens.cuda()
            build_doc_layout(tokens, EOD)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        seconds, layout = time_layout(tokens, repeats, device)
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = allocated_cpu_bytes(tokens)
        out_bytes = sum(t.numel() * t.element_size()
                        for t in (layout.cu_seqlens, layout.position_ids, layout.loss_mask))
        mcore = megatron_loop_seconds(tokens.cpu())
        print(f"{b:>3}x{s:<6} {layout.num_docs:>6} {seconds * 1e3:>10.2f} {peak / 2**20:>9.1f} "
              f"{out_bytes / 2**20:>11.2f} {b * s * s / 2**30:>15.1f} "
              f"{4 * s * s / 2**30:>14.1f} {mcore * 1e3:>14.1f}")


def bench_preprocess(corpus_bytes, repeat):
    from megatron_eod.data.preprocess import preprocess_jsonl
    from megatron_eod.data.sample_corpus import write_sample_corpus
    from megatron_eod.data.tokenizers import ByteTokenizer

    print(f"== tools/preprocess_data.py throughput (sample corpus, ByteTokenizer, "
          f"{os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory() as tmp:
        one = os.path.join(tmp, "one.jsonl")
        stats = write_sample_corpus(one, max_bytes=corpus_bytes)
        # The stdlib holds ~8 MB of text: repeat it so pool start-up does not dominate.
        src = os.path.join(tmp, "corpus.jsonl")
        with open(one, "rb") as f, open(src, "wb") as out:
            out.write(f.read() * repeat)
        print(f"corpus: {stats['documents']} documents x {repeat}, "
              f"{os.path.getsize(src) / 1e6:.1f} MB jsonl")
        tokenizers = [("ByteTokenizer", ByteTokenizer())]
        bpe = train_bpe(one, os.path.join(tmp, "tokenizer.json"))
        if bpe is not None:
            tokenizers.append(("HF BPE 8k", bpe))
        for name, tokenizer in tokenizers:
            for workers in (1, 2):
                best = None
                for trial in range(3):
                    run = preprocess_jsonl(src, os.path.join(tmp, f"out{workers}_{trial}"),
                                           tokenizer, append_eod=True, workers=workers,
                                           log=lambda msg: None)
                    best = run if best is None or run.seconds < best.seconds else best
                docs_s, tokens_s, mb_s = best.rates()
                print(f"{name:>13} workers={workers}: {mb_s:6.1f} MB/s  {docs_s:8.0f} docs/s  "
                      f"{tokens_s / 1e6:6.2f} M tokens/s  (best of 3, {best.seconds:.2f} s)")


def train_bpe(corpus, path):
    """An 8k byte-level BPE trained on the corpus (a realistic, slower tokenizer), or None."""
    try:
        import tokenizers
    except ImportError:
        print("(tokenizers not installed: HF BPE row skipped)")
        return None
    import json

    from megatron_eod.data.tokenizers import build_tokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    with open(corpus, encoding="utf-8") as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    tok.save(path)
    return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--corpus-bytes", type=int, default=8_000_000)
    p.add_argument("--corpus-repeat", type=int, default=4, help="copies of the corpus to time")
    p.add_argument("--skip-preprocess", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.corpus_repeat < 1 or args.corpus_bytes < 1:
        p.error("--repeats, --corpus-repeat and --corpus-bytes must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU")
    bench_layouts(args.device, args.repeats)
    if not args.skip_preprocess:
        bench_preprocess(args.corpus_bytes, args.corpus_repeat)


if __name__ == "__main__":
    main()
