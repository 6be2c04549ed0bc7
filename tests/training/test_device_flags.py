"""The flag rules of what needs CUDA, and of what a GPU run needs, through Megatron-LM's REAL
parser (`parsed_flags.checked`): refused at start-up on a CPU, or on CUDA without the
kernels, precision or backend the attention needs; one FlagError line each."""

import sys

import pytest

from megatron_eod.training.cp_flags import FlagError
from tests.training.megatron_lm_checkout import megatron_lm_knows
from tests.training.parsed_flags import BASE, checked


def test_cuda_graphs_capture_only_what_holds_no_attention():
    """Graphs of the MLP pass; a scope with attention is refused (the graph would replay one
    micro-batch's plan)."""
    scope = "--cuda-graph-modules" if megatron_lm_knows("--cuda-graph-modules") else \
        "--cuda-graph-scope"  # Megatron-LM 0.19 renamed it
    assert checked("--cuda-graph-impl", "local", scope, "mlp").cuda_graph_impl == "local"
    with pytest.raises(FlagError, match="--cuda-graph-impl transformer_engine with scope "
                                        "attn mlp: a CUDA graph would replay"):
        checked("--cuda-graph-impl", "transformer_engine", scope, "attn", "mlp")

def test_the_persistent_checkpoint_worker_needs_cuda():
    """Megatron-LM's worker sets a CUDA device: on CPU it died at the first save and the run
    waited for that save forever (a helper's sweep: 400 s, killed). Plain --async-save, which
    Megatron-LM turns off without the worker, still passes."""
    checked("--async-save", "--ckpt-format", "torch_dist")
    with pytest.raises(FlagError, match=r"--use-persistent-ckpt-worker needs CUDA: "):
        checked("--async-save", "--use-persistent-ckpt-worker", "--ckpt-format", "torch_dist")

def test_what_needs_cuda_is_refused_at_start_up_on_cpu(monkeypatch):
    """Megatron-LM's example scripts on a CPU (a helper's sweep): --bf16 built the model and
    stopped at the first forward (ValueError in the CPU attention), --fp16 in the grad
    scaler (AssertionError), --profile after --profile-step-start iterations (CUDA's
    profiler); one line each now, at start-up. The PyTorch profiler still runs.
    Likewise --distributed-backend nccl (a helper's sweep of the CP functional configs)."""
    for flag in ("--bf16", "--fp16"):
        with pytest.raises(FlagError, match=f"{flag} needs CUDA: the CPU attention kernel "
                                            f"takes float32/float64; drop {flag} on CPU"):
            checked(flag)
    with pytest.raises(FlagError, match=r"--profile needs CUDA \(Megatron-LM starts CUDA's "
                                         r"profiler at --profile-step-start\); add "
                                         r"--use-pytorch-profiler"):
        checked("--profile")
    assert checked("--profile", "--use-pytorch-profiler").profile
    # Megatron-LM's default backend (a traceback in init_process_group on every rank).
    base = [f for f in BASE if f not in ("--distributed-backend", "gloo")]
    with pytest.raises(FlagError, match=r"--distributed-backend nccl \(Megatron-LM's default "
                                        r"where none is given\) needs CUDA; pass "
                                        r"--distributed-backend gloo on CPU"):
        checked(base=base)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--distributed-backend", "nccl"])
    with pytest.raises(FlagError, match=r"^--distributed-backend nccl needs CUDA"):
        checked("--distributed-backend", "nccl")  # given: not called Megatron-LM's default

@pytest.mark.parametrize("flag", ["--overlap-grad-reduce", "--overlap-param-gather"])
def test_gloo_on_cuda_refuses_overlapped_gradient_collectives(monkeypatch, flag):
    """gloo on CUDA reduces gradients bucket by bucket, synchronously (gloo_on_cuda): the
    overlap flags are refused there; nccl, and gloo on CPU, keep them."""
    import torch

    extra = [flag, "--use-distributed-optimizer"]
    assert getattr(checked(*extra, "--distributed-backend", "gloo"), flag[2:].replace("-", "_"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert getattr(checked(*extra, "--bf16", "--distributed-backend", "nccl"),
                   flag[2:].replace("-", "_"))
    with pytest.raises(FlagError, match=flag + " needs --distributed-backend nccl on CUDA"):
        checked(*extra, "--distributed-backend", "gloo", "--bf16")

def test_use_flash_attn_needs_a_flash_attn_the_attention_can_use(monkeypatch):
    """Megatron-LM's --use-flash-attn picks our flash-attn kernel: refused at start-up
    without CUDA or without a usable flash-attn (attention/backends.py)."""
    import sys
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FlagError, match="--use-flash-attn needs CUDA"):
        checked("--use-flash-attn")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    old = types.ModuleType("flash_attn")
    old.__version__ = "2.5.9"
    monkeypatch.setitem(sys.modules, "flash_attn", old)
    with pytest.raises(FlagError, match=r"--use-flash-attn .*2\.5\.9 .*>= 2\.6"):
        checked("--use-flash-attn", "--bf16")
    old.__version__ = "2.7.4.post1"
    assert checked("--use-flash-attn", "--bf16").use_flash_attn
    with pytest.raises(FlagError, match=r"on CUDA .* pass --bf16 or --fp16"):
        checked("--use-flash-attn")  # float32: no GPU kernel of ours takes it

@pytest.mark.parametrize("hidden,heads,kv_channels,ok", [
    (96, 4, None, True),   # head dim 24
    (60, 6, None, False),  # 10
    (96, 4, 12, False),
    (96, 4, 264, False),
    (96, 4, 256, True)])
def test_gpu_head_dim_is_one_the_flash_kernels_take(monkeypatch, hidden, heads, kv_channels, ok):
    """On CUDA in half precision the head dim, however it comes, must be a multiple of 8 and
    at most 256 (FlashAttention-2, called below the wrappers that would pad); on CPU the
    exact kernel takes any."""
    import torch

    flags = ["--hidden-size", str(hidden), "--num-attention-heads", str(heads)]
    if kv_channels is not None:
        flags += ["--kv-channels", str(kv_channels)]
    checked(*flags)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if ok:
        checked(*flags, "--bf16")
        return
    with pytest.raises(FlagError, match=r"head dim \(--kv-channels.*multiple of 8, at most 256"):
        checked(*flags, "--bf16")

def test_flash_attn_missing(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    with pytest.raises(FlagError, match=r"--use-flash-attn .*pip install flash-attn"):
        checked("--use-flash-attn", "--bf16")
