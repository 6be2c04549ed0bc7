#!/usr/bin/env python3
"""Merge indexed datasets into one, with Megatron's flags (see megatron_eod/data/merge.py).

    python tools/merge_datasets.py --input data/shards --output-prefix data/corpus_text_document
merges every .bin/.idx pair in data/shards (sorted by name) into data/corpus_text_document
.bin/.idx/.json; --input also takes dataset prefixes (or their .bin/.idx paths), in order.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_eod.data.merge import MergeError, merge_datasets  # noqa: E402


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, nargs="+", metavar="INPUT",
                   help="directories of datasets (every .bin/.idx pair, sorted by name) or "
                        "dataset prefixes, merged in that order")
    p.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX.bin/.idx (and .json where every part has one)")
    p.add_argument("--multimodal", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.multimodal:
        p.error("--multimodal is not supported: multimodal datasets (sequence modes) are not "
                "GPT pretraining data")
    return args


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        stats = merge_datasets(args.input, args.output_prefix,
                               log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (MergeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"done: {len(stats.parts)} datasets, {stats.documents} documents, {stats.tokens} "
          f"tokens -> {args.output_prefix}.bin/.idx", file=sys.stderr)
    if stats.without_metadata:
        print(f"note: {len(stats.without_metadata)} of them have no metadata file (made by "
              f"Megatron's own tool?), e.g. {stats.without_metadata[0]}: the merged dataset has "
              f"none either, so training checks it by a bounded scan and cannot check its "
              f"tokenizer", file=sys.stderr)
    if stats.tokens == 0:
        print("warning: the merged dataset holds no tokens: megatron-core cannot open it to "
              "train (the trainers refuse it at start-up)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
