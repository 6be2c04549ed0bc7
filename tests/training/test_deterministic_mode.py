"""--deterministic-mode in the lean trainer, as Megatron-LM's (115 of its 142 GPT functional-test
configs pass it): torch's deterministic algorithms on for the run and given back after,
megatron-core's deterministic embedding, two runs bitwise equal, and its start-up rules named
(the fused cross entropy; on CUDA, CUBLAS_WORKSPACE_CONFIG and NCCL_ALGO)."""

import pytest
import torch

from megatron_eod.training.args import parse_args
from megatron_eod.training.cp_flags import FlagError
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train


def _train_and_look(rank, world, argv):
    """The run's losses, whether deterministic algorithms and the config's deterministic mode
    were on during its steps, and whether the setting was given back after."""
    from megatron_eod.training import pretrain as module

    seen = []
    step = module._Trainer._train_step

    def train_step(self):
        seen.append((torch.are_deterministic_algorithms_enabled(),
                     self.chunks[0].config.deterministic_mode))
        return step(self)

    module._Trainer._train_step = train_step
    code, text, losses = _train(rank, world, argv)
    return code, text, losses, seen, torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("split", [("--context-parallel-size", "2"),
                                   ("--context-parallel-size", "2",
                                    "--context-parallel-algo", "ulysses"),
                                   ("--tensor-model-parallel-size", "2")])
def test_deterministic_runs_are_bitwise_equal(tiny_data, split):
    """Also a check that no step reads memory it never wrote: deterministic mode fills
    torch.empty with NaN, which would reach the loss."""
    argv = tiny_flags(tiny_data, *split, "--deterministic-mode")
    runs = [run_ranks(_train_and_look, 2, argv) for _ in range(2)]
    for results in runs:
        assert [code for code, *_ in results] == [0, 0], results
        for _, _, losses, seen, after in results:
            assert seen and all(on == (True, True) for on in seen), seen
            assert after is False  # given back
    first, second = ([losses for _, _, losses, _, _ in results] for results in runs)
    assert first == second  # bitwise
    assert all(torch.tensor(first[-1]).isfinite())


def test_the_default_mode_is_off_and_trains_the_same_numbers(tiny_data):
    argv = tiny_flags(tiny_data, "--context-parallel-size", "2")
    default = run_ranks(_train_and_look, 2, argv)
    deterministic = run_ranks(_train_and_look, 2, argv + ["--deterministic-mode"])
    assert [seen for *_, seen, _ in default] and all(
        on == (False, False) for *_, seen, _ in default for on in seen)
    assert torch.allclose(torch.tensor(deterministic[-1][2]), torch.tensor(default[-1][2]),
                          rtol=1e-5)


_BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--lr", "1e-3", "--train-iters", "10", "--mock-data"]


def test_deterministic_mode_refuses_the_fused_cross_entropy():
    with pytest.raises(FlagError, match=r"--deterministic-mode with --cross-entropy-loss-fusion"):
        parse_args(_BASE + ["--deterministic-mode", "--cross-entropy-loss-fusion"],
                   world_size=1, cuda_available=False)


_GPU = _BASE + ["--bf16", "--deterministic-mode"]


@pytest.mark.parametrize("cublas,nccl,extra,error", [
    (None, "Ring", (), r"needs the environment variable CUBLAS_WORKSPACE_CONFIG set to "
                      r":4096:8 or :16:8 \(torch's rule for deterministic cuBLAS\), got None"),
    (":4096:2", "Ring", (), r"CUBLAS_WORKSPACE_CONFIG .* got ':4096:2'"),
    (":4096:8", None, (), r"--deterministic-mode with NCCL needs the environment variable "
                          r"NCCL_ALGO set to one of Tree, Ring, .* got None"),
    (":16:8", "Auto", (), r"NCCL_ALGO .* got 'Auto'"),
    (":16:8", "Tree", (), None),
    (":4096:8", None, ("--distributed-backend", "gloo"), None),  # no NCCL, no NCCL_ALGO
])
def test_deterministic_mode_on_cuda_needs_its_environment(monkeypatch, cublas, nccl, extra,
                                                          error):
    for name, value in (("CUBLAS_WORKSPACE_CONFIG", cublas), ("NCCL_ALGO", nccl)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    if error is None:
        assert parse_args(_GPU + list(extra), world_size=1, cuda_available=True).deterministic_mode
    else:
        with pytest.raises(FlagError, match=error):
            parse_args(_GPU + list(extra), world_size=1, cuda_available=True)


def test_off_the_machine_rules_do_not_apply_on_cpu(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    assert parse_args(_GPU[:-2] + ["--deterministic-mode"], world_size=1,
                      cuda_available=False).deterministic_mode
