#!/usr/bin/env python3
"""jsonl -> Megatron indexed dataset, with Megatron's flags (see megatron_eod/data/preprocess.py).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --append-eod
writes data/corpus_text_document.bin/.idx; train with --data-path data/corpus_text_document.
--input takes several files, glob patterns ('shards/*.jsonl.zst', sorted), .gz/.bz2/.xz/.zst
files and - (stdin); their documents go into one dataset, in that order.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_eod.data.preprocess import PreprocessError, preprocess_jsonl  # noqa: E402
from megatron_eod.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, nargs="+", metavar="INPUT",
                   help="jsonl files (one document a line), glob patterns (quoted; matches "
                        "sorted), .gz/.bz2/.xz/.zst files, or - for stdin: one dataset, in order")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed lines instead of stopping at the first")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="ByteTokenizer", choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFace dir or tokenizer.json, SentencePiece .model, TikToken .json")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="for NullTokenizer (and TikTokenizer: default 131072)")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default="v2")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--tiktoken-special-tokens", nargs="+", default=None)
    g.add_argument("--append-eod", action="store_true", help="append the EoD id to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between reports")
    g.add_argument("--partitions", type=int, default=1,
                   help="Megatron's: accepted, not needed (the workers read all inputs' chunks "
                        "in parallel; the output is the same)")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="Megatron's: accepted; documents always keep the inputs' order")
    g.add_argument("--lang", default=None, help="Megatron's: accepted; only sentence "
                                                "splitting (not supported) reads it")
    g.add_argument("--keep-newlines", action="store_true", help="as --lang")
    for flag in _NOT_SUPPORTED:
        g.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag, why in _NOT_SUPPORTED.items():
        given = getattr(args, flag[2:].replace("-", "_"))
        if given is not None and given != _HARMLESS.get(flag):
            p.error(f"{flag} is not supported: {why}")
    if args.partitions < 1:
        p.error(f"--partitions must be >= 1, got {args.partitions}")
    return args


_SENTENCES = ("no sentence splitting: with EoD reset the document is the unit, and sentences "
              "written as sequences would be shuffled apart by GPTDataset; drop the flag")
# Megatron's flags that this tool refuses, and why.
_NOT_SUPPORTED = {
    "--split-sentences": _SENTENCES,
    **dict.fromkeys(("--find-optimal-num-workers", "--workers-to-check", "--max-documents",
                     "--performance-dir"),
                    "no worker-count search; the progress lines give MB/s for a --workers "
                    "value, and the output does not depend on it"),
    "--vocab-extra-ids": "T5's sentinel tokens are not used by GPT pretraining",
}
_HARMLESS = {"--vocab-extra-ids": ["0"]}  # values that ask for nothing (Megatron's defaults)


def progress_printer():
    """One updating line on a terminal, one line per report otherwise (logs, CI)."""
    if sys.stderr.isatty():
        return lambda msg: print("\r" + msg, end="", file=sys.stderr, flush=True)
    return lambda msg: print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                                    args.merge_file, args.vocab_size, args.tiktoken_pattern,
                                    args.tiktoken_num_special_tokens,
                                    args.tiktoken_special_tokens)
        stats = preprocess_jsonl(args.input, args.output_prefix, tokenizer,
                                 json_keys=args.json_keys, append_eod=args.append_eod,
                                 workers=args.workers, log_interval=args.log_interval,
                                 skip_bad_lines=args.skip_bad_lines, log=progress_printer())
    except (PreprocessError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    docs_s, tokens_s, mb_s = stats.rates()
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if args.partitions > 1:
        print(f"note: --partitions {args.partitions} was not needed: the {args.workers} "
              f"workers read the inputs' chunks in parallel", file=sys.stderr)
    print(f"done: {len(stats.inputs)} input{'s' * (len(stats.inputs) > 1)}, "
          f"{stats.documents} documents ({stats.empty_documents} empty), {stats.tokens} "
          f"tokens, {stats.bytes_read / 1e6:.2f} MB in {stats.seconds:.2f} s "
          f"({docs_s:.0f} docs/s, {tokens_s:.0f} tokens/s, {mb_s:.2f} MB/s)", file=sys.stderr)
    if stats.blank_lines:
        print(f"note: {stats.blank_lines} blank lines skipped", file=sys.stderr)
    if stats.skipped_lines:
        print(f"warning: {stats.skipped_lines} bad lines skipped (first: {stats.first_skipped})",
              file=sys.stderr)
    if stats.tokens == 0:  # a shard of empty documents merges; alone it cannot train
        print("warning: the dataset holds no tokens: megatron-core cannot open it to train "
              "(the trainers refuse it at start-up); merge it with others "
              "(tools/merge_datasets.py) or check --input and --json-keys", file=sys.stderr)
    for key, prefix in stats.outputs.items():
        print(f"{key}: {prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
