"""`megatron_eod.training.args`: the GPU-only rules (half precision, the head dim the flash
kernels take, --use-flash-attn and which flash-attn, gloo on CUDA), exercised both ways on
any machine: `cuda_available` is passed explicitly and flash-attn is a module put in
sys.modules. CPU only, no process groups."""

import sys
import types

import pytest
import torch

from megatron_eod.training.args import FlagError
from tests.training.test_args import parse


@pytest.mark.parametrize("flags,dtype", [
    (["--bf16"], torch.bfloat16), (["--fp16"], torch.float16)])
def test_cuda_dtypes_and_backend(flags, dtype):
    args = parse(*flags, cuda=True)
    assert args.params_dtype is dtype and args.distributed_backend == "nccl"
    assert parse(*flags, "--distributed-backend", "gloo", cuda=True).distributed_backend == "gloo"


def test_float32_attention_is_refused_on_cuda_at_start_up():
    """The GPU flash kernels take half precision only: said before any data or model work,
    not at the first layer; on CPU float32 is the default."""
    with pytest.raises(FlagError, match=r"on CUDA .* pass --bf16 or --fp16"):
        parse(cuda=True)
    assert parse().params_dtype is torch.float32


@pytest.mark.parametrize("flag", ["--overlap-grad-reduce", "--overlap-param-gather"])
def test_gloo_on_cuda_refuses_overlapped_gradient_collectives(flag):
    extra = ["--use-distributed-optimizer"] if flag == "--overlap-param-gather" else []
    with pytest.raises(FlagError, match=flag + r" needs --distributed-backend nccl on CUDA"):
        parse(flag, *extra, "--distributed-backend", "gloo", "--bf16", cuda=True)
    assert getattr(parse(flag, *extra, "--bf16", cuda=True),
                   flag[2:].replace("-", "_"))  # nccl
    assert getattr(parse(flag, *extra), flag[2:].replace("-", "_"))  # gloo on CPU


def _flash_attn(monkeypatch, version):
    module = types.ModuleType("flash_attn")
    module.__version__ = version
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def test_flash_attn_available(monkeypatch):
    _flash_attn(monkeypatch, "2.8.3")
    assert parse("--use-flash-attn", "--bf16", cuda=True).use_flash_attn


def test_flash_attn_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    with pytest.raises(FlagError, match=r"--use-flash-attn .*pip install flash-attn"):
        parse("--use-flash-attn", "--bf16", cuda=True)


def test_flash_attn_too_old(monkeypatch):
    _flash_attn(monkeypatch, "2.5.8")  # pads the varlen lse per sequence
    with pytest.raises(FlagError, match=r"--use-flash-attn .*2\.5\.8 .*>= 2\.6"):
        parse("--use-flash-attn", "--bf16", cuda=True)


@pytest.mark.parametrize("hidden,heads,kv_channels,ok", [
    (96, 4, None, True),   # head dim 24
    (60, 6, None, False),  # 10
    (96, 4, 12, False),
    (96, 4, 264, False),
    (96, 4, 256, True)])
def test_gpu_head_dim_is_one_the_flash_kernels_take(hidden, heads, kv_channels, ok):
    """On CUDA in half precision the head dim, however it comes, must be a multiple of 8 and
    at most 256 (FlashAttention-2, called below the wrappers that would pad); on CPU the
    exact kernel takes any."""
    flags = ["--hidden-size", str(hidden), "--num-attention-heads", str(heads)]
    if kv_channels is not None:
        flags += ["--kv-channels", str(kv_channels)]
    if ok:
        parse(*flags, "--bf16", cuda=True)
        return
    with pytest.raises(FlagError, match=r"head dim \(--kv-channels.*multiple of 8, at most 256"):
        parse(*flags, "--bf16", cuda=True)
    parse(*flags)
