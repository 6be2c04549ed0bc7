"""Bad inputs to the attention stage raise ValueError naming the argument and the rule."""

import pytest
import torch
import torch.distributed as dist

from megatron_eod import context_parallel_attention, create_hybrid_groups, plan_context_parallel
from megatron_eod.attention.backends import get_backend
from tests.harness import run_ranks


def _attempt(rank, world, case):
    plan = plan_context_parallel([0, 16, 32], world, "ulysses" if case == "heads" else "ring")
    n = 32 // world
    q, k = torch.randn(n, 3, 4), torch.randn(n, 1, 4)
    calls = {
        "heads": lambda: context_parallel_attention(q, k, k, plan),
        "tokens": lambda: context_parallel_attention(q[:-1], k[:-1], k[:-1], plan),
        "plan_size": lambda: context_parallel_attention(
            q, k, k, plan_context_parallel([0, 32], 4)),
        "kv_shape": lambda: context_parallel_attention(q, k, torch.randn(n, 2, 4), plan),
        "dtype": lambda: context_parallel_attention(q, k.double(), k.double(), plan),
        "causal": lambda: context_parallel_attention(q, k, k, plan, causal=False),
        "gqa": lambda: context_parallel_attention(q, torch.randn(n, 2, 4),
                                                  torch.randn(n, 2, 4), plan),
        "no_kv_heads": lambda: context_parallel_attention(q, k[:, :0], k[:, :0], plan),
        "no_heads": lambda: context_parallel_attention(q[:, :0], k, k, plan),
        "no_head_dim": lambda: context_parallel_attention(q[..., :0], k[..., :0], k[..., :0],
                                                          plan),
        "hybrid_degree": lambda: create_hybrid_groups(dist.group.WORLD, None),
        "hybrid_degree_text": lambda: create_hybrid_groups(dist.group.WORLD, "2"),
        "hybrid_cp_group": lambda: create_hybrid_groups([0, 1], 2),
        "hybrid_groups": lambda: context_parallel_attention(
            torch.randn(32 // world, 4, 4), k, k,
            plan_context_parallel([0, 32], world, "hybrid", 1)),
    }
    try:
        calls[case]()
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("case,message", [
    ("heads", r"attention heads \(3.*divisible by the Ulysses degree \(2\)"),
    ("tokens", r"q has 15 tokens but the plan gives each rank 16"),
    ("plan_size", r"plan is for cp_size 4 but the process group has 2 ranks"),
    ("kv_shape", "k and v must match"),
    ("dtype", "must share a dtype"),
    ("causal", r"causal must be True \(EoD-reset training is causal\), got False"),
    ("gqa", r"attention heads \(3\) must be divisible by key/value heads \(2\)"),
    ("no_kv_heads", "one key/value head"),  # was ZeroDivisionError
    ("no_heads", "need at least one attention head"),  # was an empty output
    ("no_head_dim", "head_dim >= 1"),
    ("hybrid_groups", "call megatron_eod.create_hybrid_groups"),
    # A helper's sweep: these were TypeErrors from a comparison, or from inside torch.
    ("hybrid_degree", r"ulysses_degree \(--ulysses-degree-in-cp\) must divide .* got None"),
    ("hybrid_degree_text", "got '2'"),
    ("hybrid_cp_group", "cp_group must be a torch.distributed ProcessGroup .* got list"),
])
def test_bad_inputs(case, message):
    import re

    for text in run_ranks(_attempt, 2, case):
        assert re.search(message, text), text


def _one_rank_inputs():
    plan = plan_context_parallel([0, 4, 8], 1)
    q, k = torch.randn(8, 2, 4), torch.randn(8, 2, 4)
    return q, k, plan


@pytest.mark.parametrize("change,message", [
    (dict(softmax_scale=float("nan")), r"softmax_scale must be None .* or a finite number, "
                                       r"got nan"),  # was an all-NaN output
    (dict(softmax_scale=float("inf")), "finite number, got inf"),  # was an all-NaN output
    (dict(softmax_scale="0.1"), "finite number, got '0.1'"),
    (dict(v="meta"), r"q, k, v must be on one device; got cpu, cpu, meta"),  # read garbage
    (dict(q="numpy"), "q must be a torch.Tensor .* got ndarray"),
    (dict(plan=None), "plan must be the CPPlan plan_context_parallel returns, got NoneType"),
    (dict(plan="layout"), "got DocLayout"),
    (dict(group=[0]), "group must be a torch.distributed ProcessGroup .* got list"),
    (dict(backend="cpu"), "backend must be None .* got 'cpu'"),
    (dict(causal=None), "causal must be True"),
])
def test_bad_argument_kinds_are_named(change, message):
    """A helper's sweep of the public API: each of these ran (an all-NaN output, or values
    read from another device's memory) or failed deep inside torch."""
    from megatron_eod import build_doc_layout

    q, k, plan = _one_rank_inputs()
    kwargs = dict(q=q, k=k, v=k, plan=plan)
    for name, value in change.items():
        if value == "meta":
            value = k.to("meta")
        elif value == "numpy":
            value = q.numpy()
        elif value == "layout":
            value = build_doc_layout(torch.tensor([[1, 2]]), 1)
        kwargs[name] = value
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(**kwargs)


def test_a_scale_of_zero_or_below_or_of_any_number_type_is_a_valid_input():
    import decimal

    import numpy as np

    q, k, plan = _one_rank_inputs()
    for scale in (0, 0.0, -0.5):
        assert torch.isfinite(context_parallel_attention(q, k, k, plan,
                                                         softmax_scale=scale)).all()
    want = context_parallel_attention(q, k, k, plan, softmax_scale=0.5)
    for scale in (np.float32(0.5), torch.tensor(0.5), decimal.Decimal("0.5")):
        assert torch.equal(context_parallel_attention(q, k, k, plan, softmax_scale=scale), want)


def test_gpu_kernels_reject_float32_before_running():
    with pytest.raises(ValueError, match="GPU varlen attention kernels take float16 or bfloat16"):
        get_backend(torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="CPU attention backend takes float32 or float64"):
        get_backend(torch.device("cpu"), torch.bfloat16)


def test_a_failed_transfer_names_itself_and_its_group():
    """Where a wait fails (a peer stopped answering), the error says which transfer and which
    group; the backend's own message is kept."""
    from megatron_eod.attention.comm import Exchange

    class TimedOut:
        def wait(self):
            raise RuntimeError("Timed out waiting 12000ms for recv operation to complete")

    pending = Exchange([TimedOut()], None, "p2p tag 3: send to group rank 1, receive from "
                                           "group rank 1", group=None)
    with pytest.raises(RuntimeError, match=r"Timed out waiting 12000ms .*\[p2p tag 3: send to "
                                           r"group rank 1.* in CP group of global ranks"):
        pending.wait()
