#!/usr/bin/env python3
"""Write the offline sample corpus (Python stdlib docstrings and definitions) as jsonl.

    python tools/make_sample_corpus.py --output data/stdlib.jsonl [--max-bytes 8000000] \
        [--methods-apart]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_eod.data.sample_corpus import write_sample_corpus  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="jsonl file to write")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="stop after this much text")
    p.add_argument("--seed", type=int, default=1234, help="shuffle seed")
    p.add_argument("--methods-apart", action="store_true",
                   help="each method of a class is a document of its own, and the rest of the "
                        "class another (shorter documents: ~480 bytes on average, not ~1,400)")
    args = p.parse_args(argv)
    if args.max_bytes <= 0:
        p.error(f"--max-bytes must be positive, got {args.max_bytes}")
    if not args.output or os.path.isdir(args.output):
        p.error(f"--output must name a file to write, got {args.output!r}")
    try:
        stats = write_sample_corpus(args.output, max_bytes=args.max_bytes, seed=args.seed,
                                    methods_apart=args.methods_apart)
    except OSError as error:
        p.error(f"--output {args.output}: cannot write it ({error.strerror or error})")
    print(f"wrote {stats['documents']} documents, {stats['bytes']} bytes of text to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
