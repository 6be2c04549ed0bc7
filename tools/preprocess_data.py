#!/usr/bin/env python3
"""jsonl -> Megatron indexed dataset, with Megatron's flags (see megatron_eod/data/preprocess.py).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --append-eod
writes data/corpus_text_document.bin/.idx; train with --data-path data/corpus_text_document.
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
    g.add_argument("--input", required=True, help="jsonl file, one document a line")
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
    return p.parse_args(argv)


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
    except (PreprocessError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    docs_s, tokens_s, mb_s = stats.rates()
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"done: {stats.documents} documents ({stats.empty_documents} empty), {stats.tokens} "
          f"tokens, {stats.bytes_read / 1e6:.2f} MB in {stats.seconds:.2f} s "
          f"({docs_s:.0f} docs/s, {tokens_s:.0f} tokens/s, {mb_s:.2f} MB/s)", file=sys.stderr)
    if stats.blank_lines:
        print(f"note: {stats.blank_lines} blank lines skipped", file=sys.stderr)
    if stats.skipped_lines:
        print(f"warning: {stats.skipped_lines} bad lines skipped (first: {stats.first_skipped})",
              file=sys.stderr)
    for key, prefix in stats.outputs.items():
        print(f"{key}: {prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
