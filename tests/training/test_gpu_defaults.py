"""The fastest attention path by default on GPUs (training/gpu_defaults.py), chosen on
Megatron-LM's own parsed args; the CUDA device's check is a stand-in here (the GPU stage
runs the real one: tests/functional/test_gpu_training.py)."""

import os
import re
import warnings

import pytest

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.gpu_defaults import choose_attention_path
from tests.training.parsed_flags import checked, megatron_lm_args

@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    """As on a GPU machine: Triton's interpreter off (tests/conftest.py sets it on CPUs)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def chosen(*flags, problem=lambda head_dim, dtype, backward=False: None):
    """Megatron-LM's args for `flags` with --bf16, resolved as on a CUDA machine whose
    device check says `problem`; -> (args, the warnings said)."""
    from megatron_eod.training import cp_flags

    args = megatron_lm_args("--bf16", *flags)
    cp_flags.resolve_cp_spellings(args)
    cp_flags.check_context_parallel(args)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        choose_attention_path(args, True, problem)
    return args, [str(w.message) for w in said]


@pytest.mark.parametrize("algo,cp,concurrent", [
    (["--context-parallel-algo", "ring"], 4, True),
    (["--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", "2"], 4, True),
    (["--context-parallel-algo", "ulysses"], 4, False),
    ([], 1, False)])
def test_on_cuda_the_fused_forward_and_concurrent_calls_are_the_default(algo, cp, concurrent):
    args, said = chosen("--context-parallel-size", str(cp), *algo)
    assert args.cp_fused_forward and args.cp_concurrent_calls is concurrent
    assert said == []


def test_on_cpu_both_are_off_and_nothing_is_said():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        args = checked("--context-parallel-size", "4")
    assert not [w for w in said if "fused" in str(w.message)]
    assert args.cp_fused_forward is False and args.cp_concurrent_calls is False


@pytest.mark.parametrize("flags,problem,reason", [
    (["--cp-ring-exchange", "steps"], None, "--cp-ring-exchange steps has no fused form"),
    (["--interpreter"], None, "TRITON_INTERPRET=1 is set"),
    ([], "its kernel does not compile for NVIDIA X (sm_75) with Triton 3.0.0: ptxas",
     "does not compile for NVIDIA X"),
    ([], RuntimeError("triton exploded\nsecond line"),
     "checking its kernel raised RuntimeError: triton exploded$")])
def test_where_the_fused_kernel_cannot_run_it_falls_back_and_says_why_once(flags, problem,
                                                                         reason):
    def device_check(head_dim, dtype, backward=False):
        assert (head_dim, dtype) == (16, "bf16")  # 64 / 4 heads
        if isinstance(problem, Exception):
            raise problem
        return problem

    if flags == ["--interpreter"]:
        os.environ["TRITON_INTERPRET"] = "1"  # the fixture restores it
        flags = []
    args, said = chosen("--context-parallel-size", "4", *flags, problem=device_check)
    assert args.cp_fused_forward is False
    assert len(said) == 1 and said[0].startswith("the attention forward runs unfused")
    assert re.search(reason, said[0].split(": ", 1)[1].split(";")[0])
    assert args.cp_concurrent_calls is (flags == [])  # steps: no concurrent form either


def test_the_no_flags_turn_each_off_without_a_word():
    args, said = chosen("--context-parallel-size", "4", "--no-cp-fused-forward",
                        "--no-cp-concurrent-calls",
                        problem=lambda *a, **k: pytest.fail("checked a flag turned off"))
    assert (args.cp_fused_forward, args.cp_concurrent_calls, said) == (False, False, [])


def test_float32_on_cuda_is_not_fused_by_default():
    from megatron_eod.training import cp_flags

    args = megatron_lm_args("--context-parallel-size", "4")
    cp_flags.resolve_cp_spellings(args)
    cp_flags.check_context_parallel(args)
    with pytest.warns(UserWarning, match="it takes --bf16 or --fp16"):
        choose_attention_path(args, True, lambda *a, **k: None)
    assert not args.cp_fused_forward


def test_the_fused_backward_alone_needs_the_fused_forward_on():
    with pytest.raises(FlagError, match=r"--cp-fused-backward needs --cp-fused-forward .*"
                                        r"default on GPUs"):
        checked("--context-parallel-size", "4", "--cp-fused-backward")
    args, _ = chosen("--context-parallel-size", "4", "--cp-fused-backward")
    assert args.cp_fused_forward and args.cp_fused_backward


def test_mla_head_dim_is_the_wider_of_qk_and_v():
    """MLA's q/k (nope + rope parts) and v head dims differ; the kernels see the wider, the
    narrower padded (megatron/core_attention.py): 128 + 64 = 192 here, checked on CUDA."""
    from megatron_eod.training.cp_flags import attention_head_dim, check_gpu_attention

    flags = ["--multi-latent-attention", "--qk-head-dim", "128", "--qk-pos-emb-head-dim",
             "64", "--v-head-dim", "128"]
    args = megatron_lm_args(*flags)
    assert attention_head_dim(args) == 192
    seen = []
    args, _ = chosen("--context-parallel-size", "4", *flags,
                     problem=lambda head_dim, dtype, backward=False: seen.append(head_dim))
    assert seen == [192] and args.cp_fused_forward
    args = megatron_lm_args("--bf16", "--multi-latent-attention", "--qk-head-dim", "200",
                            "--qk-pos-emb-head-dim", "64")
    with pytest.raises(FlagError, match=r"--multi-latent-attention the wider .* is 264"):
        check_gpu_attention(args, True)
