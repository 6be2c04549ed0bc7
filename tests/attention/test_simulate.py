"""One-process simulation of a plan's per-group compute (the GPU check on a single device).

CPU float64: out and q/k/v gradients equal the dense document-masked oracle to 1e-10 for ring,
hybrid and ulysses plans on random layouts, with both ring executors (batched, steps), the
batched ones also with concurrent_calls (in sequence on a CPU, the local call in its two
parts: the CPU kernel writes into given tensors). GPU (marked): the same in
bf16 through PyTorch's flash kernels, where the error must stay within twice that of ONE
varlen call over the whole stream (both against float64): bf16 rounding is the only
difference, so a planning or merging bug (errors of order 1) fails it while kernel rounding
(order 1e-2) passes; with concurrent_calls (two CUDA streams) the forward output must also
equal the one-stream run's bit for bit, run after run (a race would not); "+split" forces
the local call's two parts on three streams where the kernel cannot write into given tensors
(PyTorch < 2.12: the parts' results are copied), and its forward must equal itself run
after run.
"""

import pytest
import torch

from megatron_eod import build_doc_layout, plan_context_parallel
from megatron_eod.attention.backends import TorchVarlenBackend, get_backend
from megatron_eod.attention.simulate import SimulatedPlan
from tests.reference import (dense_document_attention, random_layout_tokens,
                             schedule_without_spans)

EOD = 50
# Ring executors as tests name them: "+concurrent" = with concurrent_calls (streams.py).
EXECUTORS = ["batched", "batched-keep", "steps", "batched+concurrent",
             "batched-keep+concurrent"]


# On a GPU also: the local call's parts on side streams even where they cost a copy.
GPU_EXECUTORS = EXECUTORS + ["batched+split", "batched-keep+split"]


def _executor(name):
    """(ring exchange, concurrent_calls) of an EXECUTORS name."""
    exchange, _, concurrent = name.partition("+")
    return exchange, bool(concurrent)


class _SplitTorchVarlen(TorchVarlenBackend):
    """PyTorch's kernels, the batched ring told they write into given tensors (they copy
    there where they cannot): the local call then runs in its two parts."""

    writes_out = writes_grads = True


def _gpu_backend(executor):
    return _SplitTorchVarlen() if executor.endswith("+split") else TorchVarlenBackend()


def _case(kind, b, s, heads, kv_heads, dim, seed, device="cpu", dtype=torch.float64):
    tokens = random_layout_tokens(kind, b, s, EOD, seed)
    cu = build_doc_layout(tokens, EOD).cu_seqlens
    gen = torch.Generator().manual_seed(seed)
    n = b * s
    q, dout = (torch.randn(n, heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(n, kv_heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    return cu, [t.to(device, dtype) for t in (q, k, v, dout)]


def _oracle(q, k, v, dout, cu, scale):
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out = dense_document_attention(q, k, v, cu.cpu(), scale)
    out.backward(dout.cpu().double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("algo,cp,degree,kind", [("ring", 4, None, "mixed"),
                                                  ("ring", 8, None, "spanning"),
                                                  ("hybrid", 8, 2, "mixed"),
                                                  ("ulysses", 4, None, "short")])
def test_simulation_equals_dense_reference(algo, cp, degree, kind, executor):
    b = 1 if kind == "spanning" else 2
    cu, (q, k, v, dout) = _case(kind, b, 128, 4, 2, 8, seed=cp)
    plan = plan_context_parallel(cu, cp, algo, degree)
    exchange, concurrent = _executor(executor)
    got = SimulatedPlan(plan, q, k, v, dout, softmax_scale=0.3, exchange=exchange,
                        concurrent_calls=concurrent).run()
    for mine, ref in zip(got, _oracle(q, k, v, dout, cu, 0.3)):
        assert (mine - ref).abs().max().item() < 1e-10


@pytest.mark.gpu
@pytest.mark.parametrize("executor", GPU_EXECUTORS)
@pytest.mark.parametrize("algo,cp,degree", [("ring", 4, None), ("ring", 8, None),
                                            ("hybrid", 8, 2), ("ulysses", 4, None)])
def test_simulation_on_gpu_in_bf16(algo, cp, degree, executor):
    cu, tensors = _case("mixed", 2, 1024, 8, 2, 64, seed=1, device="cuda",
                        dtype=torch.bfloat16)
    q, k, v, dout = tensors
    plan = plan_context_parallel(cu, cp, algo, degree)
    ref = _oracle(q, k, v, dout, cu, 0.125)
    exchange, concurrent = _executor(executor)
    backend = _gpu_backend(executor)
    got = SimulatedPlan(plan, q, k, v, dout, backend, 0.125, exchange, concurrent).run()
    if concurrent:  # side streams: the same forward bits run after run (and, for the whole
        # local call beside the received keys' call, as one stream)
        both = SimulatedPlan(plan, q, k, v, dout, backend, 0.125, exchange, True)
        split = executor.endswith("+split")
        alone = both if split else SimulatedPlan(plan, q, k, v, dout, backend, 0.125, exchange)
        for g in range(plan.ring_size):
            expected = alone.forward_group(g)[0]
            for _ in range(5):
                assert torch.equal(both.forward_group(g)[0], expected)
    one = SimulatedPlan(plan_context_parallel(cu, 1, "ring"), q, k, v, dout,
                        TorchVarlenBackend(), 0.125).run()
    for name, mine, single, exact in zip(("out", "dq", "dk", "dv"), got, one, ref):
        err = (mine.cpu().double() - exact).abs().max().item()
        base = (single.cpu().double() - exact).abs().max().item()
        print(f"[figure] simulated {algo} ({executor}) cp={cp} bf16 {name}: max error vs "
              f"float64 {err:.2e}, "
              f"CP=1's {base:.2e}")
        assert err <= 2 * base + 1e-3, (name, err, base)


@pytest.mark.gpu
@pytest.mark.parametrize("executor", GPU_EXECUTORS)
@pytest.mark.parametrize("algo,cp,degree", [("ring", 4, None), ("hybrid", 8, 2)])
def test_ring_steps_make_no_host_syncs_on_gpu(algo, cp, degree, executor):
    """The schedule executors' forward and backward (every group's kernels, merges, gathers
    and gradient sums) run with no device-to-host synchronisation: the plan is moved once,
    before (SimulatedPlan does), and nothing inside asks the GPU for a value."""
    cu, tensors = _case("mixed", 2, 1024, 8, 2, 64, seed=2, device="cuda",
                        dtype=torch.bfloat16)
    plan = plan_context_parallel(cu, cp, algo, degree)
    run_without_host_syncs(SimulatedPlan(plan, *tensors, _gpu_backend(executor), 0.125,
                                         *_executor(executor)))


def run_without_host_syncs(simulated):
    """Every group's forward and backward once (compiling the fused merges, by index and on
    runs of rows, or a Triton kernel: compiling may sync), then again where any device-to-host
    synchronisation raises (running must not)."""
    for g in range(len(simulated.schedules)):
        simulated.run_group(g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in range(len(simulated.schedules)):
            simulated.run_group(g)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _spans_seen(schedule, exchange):
    """Which of queries, keys and sent rows the schedule takes as runs (False) or by index
    (True), for the executor `exchange`."""
    if exchange == "steps":
        sends = [(step.send_index, step.send_span) for step in schedule.steps]
        calls = [step.call for step in schedule.steps]
    else:
        batched = schedule.batched
        sends = [(batched.send_index, batched.send_span)] if batched else []
        calls = [batched.call] if batched else []
    seen = {("send", span is None) for index, span in sends if index.numel()}
    for call in calls:
        if call is not None:
            seen |= {("q", call.q_span is None), ("k", call.k_span is None)}
    return seen


@pytest.mark.parametrize("exchange", ["batched", "steps"])
def test_row_runs_as_slices_equal_gathers_and_the_reference(exchange):
    """The ring executors take a run of rows as a slice (a view) and other rows by index. Over
    these layouts both kinds occur for queries, keys (the steps only: the batched call reads
    its buffer in order) and sent rows; each result equals the same plan computed with every
    row by index, and the oracle."""
    seen = set()
    for algo, cp, degree, kind, seed, b in (("ring", 4, None, "mixed", 1, 3),
                                            ("ring", 8, None, "spanning", 2, 1),
                                            ("hybrid", 8, 2, "mixed", 3, 3),
                                            ("ring", 4, None, "short", 4, 3),
                                            ("ring", 2, None, "spanning", 5, 1),
                                            ("ring", 4, None, "mixed", 6, 1)):
        cu, (q, k, v, dout) = _case(kind, b, 96, 4, 2, 8, seed=seed)
        plan = plan_context_parallel(cu, cp, algo, degree)
        for schedule in plan.schedules:
            seen |= _spans_seen(schedule, exchange)
        spans = SimulatedPlan(plan, q, k, v, dout, softmax_scale=0.3, exchange=exchange)
        gathers = SimulatedPlan(plan, q, k, v, dout, softmax_scale=0.3, exchange=exchange)
        gathers.schedules = [schedule_without_spans(s) for s in gathers.schedules]
        oracle = _oracle(q, k, v, dout, cu, 0.3)
        for mine, other, ref in zip(spans.run(), gathers.run(), oracle):
            assert (mine - other).abs().max().item() < 1e-12
            assert (mine - ref).abs().max().item() < 1e-10
    every = {(what, none) for what in ("send", "q", "k") for none in (True, False)}
    if exchange == "batched":  # its keys are always the received buffer, as laid out
        every.discard(("k", True))
    assert seen == every, seen


def test_without_batched_forms_the_steps_run():
    """A plan where the end of a document would receive too much at once (one document over
    8 groups: its last group receives 7x its rows) carries no batched forms; the batched
    executor refuses such a schedule (it would drop every received key), and the attention
    runs the steps instead, exactly."""
    from megatron_eod.attention.batched import batched_forward

    cu, (q, k, v, dout) = _case("spanning", 1, 128, 4, 2, 8, seed=1)
    plan = plan_context_parallel(cu, 8, "ring")
    assert not plan.batched_ring and all(s.batched is None for s in plan.schedules)
    sim = SimulatedPlan(plan, q, k, v, dout, softmax_scale=0.3)  # exchange="batched"
    last = sim.schedules[-1]
    with pytest.raises(ValueError, match="no batched form"):
        batched_forward(q[:16], k[:16], v[:16], last, None, sim.backend, 0.3)
    for mine, ref in zip(sim.run(), _oracle(q, k, v, dout, cu, 0.3)):
        assert (mine - ref).abs().max().item() < 1e-10


def test_batched_executor_refuses_a_call_that_does_not_read_its_buffer_in_order():
    """The batched executor takes the received buffer as the call's keys (views); a call
    whose keys are anything else (here: the buffer reversed) is refused, not computed."""
    import dataclasses

    from megatron_eod.attention.batched import batched_forward

    cu, (q, k, v, dout) = _case("spanning", 1, 128, 4, 2, 8, seed=1)
    plan = plan_context_parallel(cu, 2, "ring")
    schedule = next(s for s in plan.schedules if s.batched and s.batched.call is not None)
    call = schedule.batched.call
    reversed_keys = dataclasses.replace(call, k_index=call.k_index.flip(0), k_span=None)
    bad = dataclasses.replace(schedule, batched=dataclasses.replace(schedule.batched,
                                                                    call=reversed_keys))
    with pytest.raises(ValueError, match="read its receive buffer once, in order"):
        batched_forward(q[:64], k[:64], v[:64], bad, None, get_backend(q.device, q.dtype), 0.3)


class _OldStyleBackend:
    """A caller's own kernel as the interface was before out= and grads=: no writes_out,
    no keyword for given tensors."""

    def __init__(self):
        from megatron_eod.attention.backends import CPUExactBackend
        self._cpu = CPUExactBackend()

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        return self._cpu.forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        return self._cpu.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal,
                                  scale)


@pytest.mark.parametrize("exchange", ["batched", "batched-keep"])
def test_concurrent_calls_with_a_kernel_that_cannot_take_given_tensors(exchange):
    """Such a kernel runs the whole local call (no split), exactly."""
    cu, (q, k, v, dout) = _case("mixed", 2, 128, 4, 2, 8, seed=4)
    plan = plan_context_parallel(cu, 4, "ring")
    assert any(s.local_parts is not None for s in plan.schedules)
    got = SimulatedPlan(plan, q, k, v, dout, _OldStyleBackend(), 0.3, exchange, True).run()
    for mine, ref in zip(got, _oracle(q, k, v, dout, cu, 0.3)):
        assert (mine - ref).abs().max().item() < 1e-10
