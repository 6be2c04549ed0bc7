#!/usr/bin/env python3
"""Draw a micro-batch from a Megatron indexed dataset and show its EoD document layout.

    python tools/show_layout.py --data-path data/corpus_text_document --seq-length 2048 \
        --micro-batch-size 2 [--no-reset-position-ids] [--eod-mask-loss]

Samples come from megatron-core's GPTDataset (BlendedMegatronDatasetBuilder), exactly what
the trainer will read; the layout is `megatron_eod.build_doc_layout`. Each dataset is first
checked against the tokenizer flags as the trainer checks it at start-up (a dataset made with
another tokenizer's EoD id is refused, not shown as rows without documents).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_eod import build_doc_layout  # noqa: E402
from megatron_eod.data.checks import check_dataset  # noqa: E402
from megatron_eod.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron_eod.megatron.dataset import build_gpt_datasets, parse_data_path  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-path", nargs="+", required=True)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--sample-index", type=int, default=0, help="first sample to draw")
    p.add_argument("--no-reset-position-ids", dest="reset_position_ids", action="store_false")
    p.add_argument("--no-reset-attention-mask", dest="reset_attention_mask",
                   action="store_false")
    p.add_argument("--eod-mask-loss", action="store_true")
    p.add_argument("--tokenizer-type", default="ByteTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--data-cache-path", default=None)
    args = p.parse_args(argv)
    if args.micro_batch_size <= 0:
        p.error(f"--micro-batch-size must be positive, got {args.micro_batch_size}")
    if args.sample_index < 0:  # (a negative one showed the last samples as rows 0..)
        p.error(f"--sample-index must be >= 0, got {args.sample_index}")

    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model,
                                    vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    vocab_size=args.vocab_size)
        for prefix in parse_data_path(args.data_path)[0]:
            check_dataset(prefix, tokenizer)
        n = args.sample_index + args.micro_batch_size
        train, _, _ = build_gpt_datasets(
            args.data_path, args.seq_length, tokenizer, num_samples=[n, 0, 0], split="100,0,0",
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
            path_to_cache=args.data_cache_path)
    except ValueError as err:
        p.error(str(err))
    except OSError as err:  # e.g. a --data-cache-path that cannot be made
        p.error(f"{err.filename or ''}: {err.strerror or err} (--data-path, --data-cache-path)")
    rows = [train[i] for i in range(args.sample_index, n)]
    tokens = torch.stack([r["tokens"] for r in rows])
    layout = build_doc_layout(tokens, tokenizer.eod, args.reset_position_ids,
                              args.reset_attention_mask, args.eod_mask_loss,
                              vocab_size=tokenizer.vocab_size)
    lengths = layout.seqlens().tolist()
    b, s = tokens.shape
    print(f"micro-batch: {b} rows x {s} tokens, {layout.num_docs} documents, "
          f"max_seqlen {layout.max_seqlen}, {int((tokens == tokenizer.eod).sum())} EoD tokens")
    print(f"document lengths (first 24): {lengths[:24]}{' ...' if len(lengths) > 24 else ''}")
    print(f"cu_seqlens (first 12): {layout.cu_seqlens[:12].tolist()}")
    for r in range(b):
        pos = layout.position_ids[r]
        restarts = (pos[1:] == 0).nonzero().flatten()[:6].add(1).tolist()
        print(f"row {r}: position ids restart at {restarts}..., "
              f"loss on {int(layout.loss_mask[r].sum())}/{s} tokens")
    metadata = sum(t.numel() * t.element_size() for t in
                   (layout.cu_seqlens, layout.position_ids, layout.loss_mask))
    print(f"layout metadata {metadata / 2**10:.1f} KiB vs Megatron's dense mask "
          f"{b * s * s / 2**20:.1f} MiB (bool [b,1,s,s])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
