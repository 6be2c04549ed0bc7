"""Documents in a packed batch: token ids + the EoD id -> a `DocLayout`.

One job: turn a `[b, s]` batch of token ids into the varlen metadata every later stage uses
(`cu_seqlens` over the row-major flattened stream, reset `position_ids`, `loss_mask`,
`max_seqlen`), with exactly the semantics of Megatron's `get_ltor_masks_and_position_ids`:

* the EoD token is the LAST token of its document; the next token starts a new one;
* a row boundary is always a document boundary (rows never attend to each other);
* `reset_attention_mask` and `reset_position_ids` are independent, as in Megatron: without
  `reset_attention_mask` each row is one causal sequence even if it holds EoDs; without
  `reset_position_ids` positions run 0..s-1 in every row;
* `eod_mask_loss` zeroes the loss where the INPUT token is the EoD.

Padded batches (fine-tuning style: a document then pad tokens) are handled by `pad_token_id`:
every maximal run of pad tokens inside a row becomes its own segment (so pads attend only to
pads of the same run and nobody attends to them), carries loss_mask 0 (as does the token just
before a run, whose label is a pad), and positions restart after it when `reset_position_ids`
is on. No separate un-padding path is needed downstream.

`doc_layout_from_starts` builds the same layout from where documents start instead (Megatron's
`--dataloader-inter-document-masking`: the dataset's document index, not EoD tokens, cuts the
documents; positions restart at every document; no loss mask of its own).

What it does not do: no dense `[s, s]` mask (only `dense_attention_mask`, for tests), no
per-document Python loop, no placement of tokens on ranks (that is `plan/`). Everything is
vectorised torch, O(b*s) time and memory, on the tensors' own device; the only host sync is
reading `max_seqlen` (one scalar).

Shape key: B = batch rows, S = sequence length, N = B*S flattened tokens, D = documents.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["DocLayout", "build_doc_layout", "dense_attention_mask", "doc_layout_from_starts"]


@dataclass(frozen=True)
class DocLayout:
    """Varlen view of a packed `[b, s]` batch (see the module docstring for the semantics).

    cu_seqlens:   int32 [D+1], document start offsets into `tokens.reshape(-1)`, ending at b*s.
    position_ids: int64 [B, S], restarted after every EoD when reset_position_ids was on.
    loss_mask:    float32 [B, S], 0 at EoD inputs (eod_mask_loss) and at pad tokens.
    max_seqlen:   length of the longest document, as a Python int (what varlen kernels take).
    """

    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    max_seqlen: int

    @property
    def batch_size(self) -> int:
        return self.position_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.position_ids.shape[1]

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def seqlens(self) -> torch.Tensor:
        """int32 [D]: the length of every document, in stream order."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def document_ids(self) -> torch.Tensor:
        """int64 [B, S]: the index of the document each token belongs to (0..D-1)."""
        n = self.batch_size * self.seq_length
        lengths_D = self.seqlens().long()
        doc_N = torch.repeat_interleave(
            torch.arange(self.num_docs, device=lengths_D.device), lengths_D, output_size=n
        )
        return doc_N.view(self.batch_size, self.seq_length)


def _token_id(name: str, value, vocab_size: Optional[int]) -> Optional[int]:
    """An integer token id of any kind (int, numpy integer, 0-d integer tensor) as an int."""
    if value is None:
        return None
    try:
        if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool:
            raise TypeError  # True is not token id 1 (numpy's bool_ has no __index__ itself)
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int token id, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if vocab_size is not None and value >= vocab_size:
        raise ValueError(f"{name}={value} is outside the vocabulary (vocab_size={vocab_size})")
    return value


def _validate(tokens, eod_token_id, pad_token_id, vocab_size):
    """-> (eod_token_id, pad_token_id) as ints, or ValueError naming the rule."""
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"tokens must be a torch.Tensor of shape [b, s], got {type(tokens)}")
    if tokens.layout != torch.strided or tokens.is_meta or tokens.is_nested:
        kind = "meta" if tokens.is_meta else "nested" if tokens.is_nested else tokens.layout
        raise ValueError(f"tokens must be a dense tensor with values, got a {kind} one")
    if tokens.dim() != 2:
        raise ValueError(
            f"tokens must have shape [b, s] (use tokens.unsqueeze(0) for one row), "
            f"got shape {tuple(tokens.shape)}"
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.numel() == 0:
        raise ValueError(f"tokens must not be empty, got shape {tuple(tokens.shape)}")
    if tokens.numel() >= 2**31:
        raise ValueError(
            f"tokens has {tokens.numel()} elements; cu_seqlens is int32, so b*s must be < 2**31"
        )
    if vocab_size is not None:
        whole = isinstance(vocab_size, float) and vocab_size.is_integer()  # 50304.0
        if isinstance(vocab_size, bool) or not (hasattr(vocab_size, "__index__") or whole) \
                or int(vocab_size) <= 0:
            raise ValueError(f"vocab_size must be None or a positive int, got {vocab_size!r}")
        vocab_size = int(vocab_size)
    eod_token_id = _token_id("eod_token_id", eod_token_id, vocab_size)
    if eod_token_id is None:
        raise ValueError("eod_token_id is required (the tokenizer's EoD id)")
    pad_token_id = _token_id("pad_token_id", pad_token_id, vocab_size)
    info = torch.iinfo(tokens.dtype)
    for name, value in (("eod_token_id", eod_token_id), ("pad_token_id", pad_token_id)):
        if value is not None and not info.min <= value <= info.max:
            raise ValueError(f"{name} {value} does not fit tokens' dtype {tokens.dtype} "
                             f"({info.min}..{info.max}): compared in it, it would wrap to "
                             f"another id; pass tokens as int64")
    if pad_token_id is not None and pad_token_id == eod_token_id:
        raise ValueError(
            f"pad_token_id must differ from eod_token_id (both are {eod_token_id}): a pad token "
            f"would then end documents"
        )
    return eod_token_id, pad_token_id


def build_doc_layout(
    tokens: torch.Tensor,
    eod_token_id: int,
    reset_position_ids: bool = True,
    reset_attention_mask: bool = True,
    eod_mask_loss: bool = False,
    pad_token_id: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> DocLayout:
    """Build the `DocLayout` of a `[b, s]` batch of token ids.

    `vocab_size`, when given, is used to reject an `eod_token_id`/`pad_token_id` outside the
    vocabulary. Runs on the device of `tokens`.
    """
    eod_token_id, pad_token_id = _validate(tokens, eod_token_id, pad_token_id, vocab_size)
    b, s = tokens.shape
    n = b * s
    device = tokens.device
    tok_N = tokens.reshape(-1)
    idx_N = torch.arange(n, device=device)

    row_start_N = idx_N % s == 0
    after_eod_N = torch.zeros(n, dtype=torch.bool, device=device)
    after_eod_N[1:] = tok_N[:-1] == eod_token_id
    # Pad runs are segments of their own: a new segment starts wherever "is pad" flips.
    pad_edge_N = torch.zeros(n, dtype=torch.bool, device=device)
    if pad_token_id is not None:
        is_pad_N = tok_N == pad_token_id
        pad_edge_N[1:] = is_pad_N[1:] != is_pad_N[:-1]

    doc_start_N = row_start_N | pad_edge_N
    if reset_attention_mask:
        doc_start_N = doc_start_N | after_eod_N
    starts_D = torch.nonzero(doc_start_N).flatten()
    cu_seqlens = torch.cat([starts_D, starts_D.new_tensor([n])]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())

    if reset_position_ids:
        pos_start_N = row_start_N | after_eod_N | pad_edge_N
        # Each token's position is its distance to the latest position start at or before it.
        last_start_N = torch.where(pos_start_N, idx_N, torch.zeros_like(idx_N))
        last_start_N = torch.cummax(last_start_N, dim=0).values
        position_ids = (idx_N - last_start_N).view(b, s)
    else:
        position_ids = torch.arange(s, device=device).expand(b, s).contiguous()

    loss_mask = torch.ones(b, s, dtype=torch.float32, device=device)
    if eod_mask_loss:
        loss_mask[tokens == eod_token_id] = 0.0
    if pad_token_id is not None:
        is_pad_BS = tokens == pad_token_id
        loss_mask[is_pad_BS] = 0.0
        # The token right before a pad run has a pad as its label (Megatron masks labels == pad).
        loss_mask[:, :-1][is_pad_BS[:, 1:]] = 0.0

    return DocLayout(
        cu_seqlens=cu_seqlens,
        position_ids=position_ids.long(),
        loss_mask=loss_mask,
        max_seqlen=max_seqlen,
    )


def doc_layout_from_starts(doc_starts: torch.Tensor) -> DocLayout:
    """The `DocLayout` of a `[b, s]` batch whose documents start where `doc_starts` is true
    (and at every row start): positions restart at each document, the loss mask is all ones
    (the caller's applies). Runs on the device of `doc_starts`."""
    if not isinstance(doc_starts, torch.Tensor) or doc_starts.dim() != 2 or \
            doc_starts.numel() == 0:
        raise ValueError(f"doc_starts must be a non-empty tensor of shape [b, s], got "
                         f"{getattr(doc_starts, 'shape', type(doc_starts))}")
    b, s = doc_starts.shape
    n = b * s
    idx_N = torch.arange(n, device=doc_starts.device)
    start_N = doc_starts.reshape(-1).bool() | (idx_N % s == 0)
    starts_D = torch.nonzero(start_N).flatten()
    cu_seqlens = torch.cat([starts_D, starts_D.new_tensor([n])]).to(torch.int32)
    last_start_N = torch.cummax(torch.where(start_N, idx_N, torch.zeros_like(idx_N)), 0).values
    return DocLayout(
        cu_seqlens=cu_seqlens,
        position_ids=(idx_N - last_start_N).view(b, s),
        loss_mask=torch.ones(b, s, dtype=torch.float32, device=doc_starts.device),
        max_seqlen=int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()),
    )


def dense_attention_mask(layout: DocLayout) -> torch.Tensor:
    """Expand a layout to Megatron's dense mask: bool [b, 1, s, s], True = masked OUT.

    O(b*s*s) memory: for tests and small inspections only, never for training.
    """
    if not isinstance(layout, DocLayout):
        raise ValueError(f"layout must be the DocLayout build_doc_layout returns, got "
                         f"{type(layout).__name__}")
    doc_BS = layout.document_ids()
    s = layout.seq_length
    same_doc_BSS = doc_BS[:, :, None] == doc_BS[:, None, :]
    causal_SS = torch.ones(s, s, dtype=torch.bool, device=doc_BS.device).tril()
    return ~(same_doc_BSS & causal_SS).unsqueeze(1)
