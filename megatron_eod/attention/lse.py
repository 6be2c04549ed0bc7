"""Merge partial attention results with their log-sum-exps.

One job: given the running (out, lse) of some query rows and a new partial (out_i, lse_i)
over more keys, produce the result over all keys:
    lse = log(exp(lse) + exp(lse_i)),  out = out * exp(lse_prev - lse) + out_i * exp(lse_i - lse)
A row that has seen no key yet has lse = -inf and out = 0 and stays so (never NaN, never +inf).

The merge updates the accumulators in place: rows by index (gather, arithmetic, scatter) or,
when the rows are one run known at planning time (`span`), a slice (no gather, no scatter).
On CUDA each form runs as one `torch.compile`d graph (dynamic shapes: row counts and offsets
change every ring step), so gather, arithmetic and scatter fuse instead of ~15 launches; set
MEGATRON_EOD_FUSED_MERGE=0 to run it eagerly.

A compiled graph writes the accumulators as it runs, so it must not fail half-way: the first
merge of each form and dtypes runs the compiled graph on copies first (also compiling the
shapes dynamo specialises: one row, offset 0), and only then on the real tensors. A failure
there, or a later compile failure (raised before the graph runs anything), switches to eager
merging for good, with a warning; a failure while a validated graph runs cannot be undone and
is raised.

Dynamo keeps a function's graphs, and counts them against its recompile limit (8), per code
object. Each form and set of dtypes gets a copy of the function with a code object of its own:
a bf16 run merges two dtype sets, 4 inductor graphs each for a run of rows (1 row or more, an
aligned offset or not), which one shared function would hold at the limit exactly, one
specialisation short of falling back to eager for the rest of the run.

Shape key: T = query rows, H = heads, D = head dim. lse is [T, H], out is [T, H, D].
"""

import os
import types
import warnings

import torch

__all__ = ["merge_into", "merged"]

_FUSED = {"compiled": {}, "failed": False, "validated": set()}


def merged(out_TH, lse_TH, part_TH, part_lse_TH):
    """-> (out, lse) over both key sets, in out's and lse's dtypes; the arithmetic is in
    lse's dtype (float32 for half-precision out: one rounding, at the end)."""
    new_lse = torch.logaddexp(lse_TH, part_lse_TH)
    # exp(-inf - -inf) would be NaN: rows still without keys keep weight 0.
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse_TH - safe).unsqueeze(-1)
    w_new = torch.exp(part_lse_TH - safe).unsqueeze(-1)
    acc = lse_TH.dtype
    new_out = out_TH.to(acc) * w_old + part_TH.to(acc) * w_new
    return new_out.to(out_TH.dtype), new_lse


def _merge_rows(out_TH, lse_TH, rows, part_TH, part_lse_TH):
    """rows: unique indices of the accumulators' rows that part_TH holds, in its order."""
    new_out, new_lse = merged(out_TH[rows], lse_TH[rows], part_TH, part_lse_TH)
    out_TH[rows] = new_out
    lse_TH[rows] = new_lse


def _merge_span(out_TH, lse_TH, start, part_TH, part_lse_TH):
    """part_TH holds the accumulators' rows start .. start + len(part_TH)."""
    stop = start + part_TH.shape[0]
    new_out, new_lse = merged(out_TH[start:stop], lse_TH[start:stop], part_TH, part_lse_TH)
    out_TH[start:stop] = new_out
    lse_TH[start:stop] = new_lse


_EAGER = {"rows": _merge_rows, "span": _merge_span}


def _own_code(fn, tag):
    """fn with a code object of its own (dynamo's graph cache and recompile count). Only
    co_name changes: co_qualname is not a replace() argument before Python 3.11."""
    name = f"{fn.__name__}_{tag}"
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _key(kind, args):
    """The form, device type and the dtypes of out, lse, part and part_lse."""
    return (kind, args[0].device.type) + tuple(args[i].dtype for i in (0, 1, 3, 4))


def _compiled(key):
    if key not in _FUSED["compiled"]:
        tag = "_".join(str(part).replace("torch.", "") for part in key[1:])
        # fullgraph: one graph, so a compile failure surfaces before anything is written.
        _FUSED["compiled"][key] = torch.compile(_own_code(_EAGER[key[0]], tag),
                                                dynamic=True, fullgraph=True)
    return _FUSED["compiled"][key]


def _rows_like(t, count):
    """A copy of t's first `count` rows with t's stride order (dynamo guards on strides)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    shape = [count] + list(t.shape[1:])
    copy = torch.empty([shape[d] for d in order], dtype=t.dtype, device=t.device)
    copy = copy.permute([order.index(d) for d in range(t.dim())])
    return copy.copy_(t[:count])


def _scratch_calls(kind, args):
    """Calls on copies of args covering dynamo's specialisations (1 row; offset 0)."""
    out, lse, where, part, part_lse = args
    out, lse = out.clone(), lse.clone()
    for count in sorted({1, part.shape[0]}):
        rows = (_rows_like(part, count), _rows_like(part_lse, count))
        if kind == "rows":
            yield (out, lse, where[:count].clone()) + rows
            continue
        for start in (0, 2):
            if start + count <= out.shape[0]:
                yield (out, lse, start) + rows


def _plain(args):
    """detach(): the same memory without a view's base, which dynamo would guard on (a view
    and a plain tensor would compile twice)."""
    return tuple(a.detach() if torch.is_tensor(a) else a for a in args)


def _validate(key, args):
    if key not in _FUSED["validated"]:
        for scratch in _scratch_calls(key[0], args):
            _compiled(key)(*_plain(scratch))
        _FUSED["validated"].add(key)


def _compile_errors():
    """Exceptions dynamo raises before a (fullgraph) graph runs: its compile failures and,
    past torch._dynamo.config.recompile_limit graphs, FailOnRecompileLimitHit."""
    exc = torch._dynamo.exc
    return (exc.TorchDynamoException, getattr(exc, "FailOnRecompileLimitHit", exc.Unsupported))


def _give_up(error):
    _FUSED["failed"] = True
    warnings.warn(f"fused log-sum-exp merge unavailable ({type(error).__name__}: {error}); "
                  "merging eagerly")


def merge_into(out_TH: torch.Tensor, lse_TH: torch.Tensor, rows: torch.Tensor,
               part_TH: torch.Tensor, part_lse_TH: torch.Tensor, span=None,
               fused=None) -> None:
    """In place: fold the partial result of `rows` (unique row indices) into the accumulators
    out/lse. `span`: (start, stop) when rows is that run; rows is then not read. `fused`:
    None = on CUDA unless MEGATRON_EOD_FUSED_MERGE=0."""
    if fused is None:
        fused = out_TH.is_cuda and os.environ.get("MEGATRON_EOD_FUSED_MERGE", "1") != "0"
    if span is not None:
        if span[1] - span[0] != part_TH.shape[0]:
            raise ValueError(f"merge_into: span {tuple(span)} holds {span[1] - span[0]} rows "
                             f"but the partial result has {part_TH.shape[0]}")
        kind, args = "span", (out_TH, lse_TH, span[0], part_TH, part_lse_TH)
    else:
        kind, args = "rows", (out_TH, lse_TH, rows, part_TH, part_lse_TH)
    if fused and not _FUSED["failed"]:
        args, key = _plain(args), _key(kind, args)
        try:
            _validate(key, args)
        except Exception as error:  # noqa: BLE001 - no real tensor was written yet
            _give_up(error)
        else:
            try:
                _compiled(key)(*args)
                return
            except _compile_errors() as error:  # a recompile failed: nothing ran
                _give_up(error)
            except Exception as error:
                raise RuntimeError(
                    "the fused log-sum-exp merge failed while updating the attention "
                    "accumulators, which are now partly written; rerun with "
                    "MEGATRON_EOD_FUSED_MERGE=0 to merge eagerly") from error
    _EAGER[kind](*args)
