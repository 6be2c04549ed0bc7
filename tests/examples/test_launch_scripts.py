"""The example launchers: every shell script parses (`bash -n`), and the GPU launchers' flags,
printed with DRY_RUN=1, pass Megatron-LM's own parser and validation with our rules for the
world size they launch, on CUDA (so a flag typo or an invalid CP layout in an example is
caught without a GPU)."""

import glob
import os
import subprocess
import sys
import types

import pytest

from tests.training.test_run import validated_argv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "examples", "**", "*.sh"), recursive=True)
                 + glob.glob(os.path.join(REPO, "examples", "**", "*.sbatch"), recursive=True)
                 + glob.glob(os.path.join(REPO, "scripts", "*.sh")) + [
                     os.path.join(REPO, ".ci", "run")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, REPO))
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", script], check=True)


def dry_run(script, algo, env):
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "gpu", script), algo],
                         env={**os.environ, **env, "DRY_RUN": "1"}, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    trainer = os.path.join(REPO, "pretrain_gpt.py")
    assert trainer in out, out
    return out[:out.index(trainer)], out[out.index(trainer) + 1:]


LAUNCHERS = [("train_1node.sh", {}, 8),
             ("train_multinode.sh", {"MASTER_ADDR": "node0", "NNODES": "2",
                                     "DATA_CACHE": "/shared/cache"}, 16),
             ("train_slurm.sbatch", {"SLURM_JOB_NUM_NODES": "2"}, 16)]


@pytest.mark.parametrize("algo", ["ring", "ulysses", "hybrid"])
@pytest.mark.parametrize("flash", ["0", "1"])
@pytest.mark.parametrize("script,env,world", LAUNCHERS, ids=[x[0] for x in LAUNCHERS])
def test_gpu_launcher_flags_are_valid(script, env, world, algo, flash, monkeypatch):
    launcher, flags = dry_run(script, algo, {**env, "USE_FLASH_ATTN": flash})
    assert ("--use-flash-attn" in flags) == (flash == "1")
    if flash == "1":  # validation checks that a usable flash_attn imports: pretend
        module = types.ModuleType("flash_attn")
        module.__version__ = "2.8.3"  # a release the attention takes
        monkeypatch.setitem(sys.modules, "flash_attn", module)
    assert "torchrun" in launcher
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in launcher  # Megatron's TP/CP overlap needs it
    assert flags[flags.index("--reset-attention-mask"):][:3] == [
        "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]  # our lines last
    args = validated_argv(monkeypatch, flags, world=world, cuda=True)
    assert args.context_parallel_size == world
    assert args.data_cache_path == env.get("DATA_CACHE")  # several nodes: a shared folder
    assert args.context_parallel_algo == algo
    assert args.reset_attention_mask and args.reset_position_ids and args.bf16
    if algo == "hybrid":  # Ulysses inside a node (8 GPUs), Ring across
        assert args.ulysses_degree == (4 if world == 8 else 8)


def test_launcher_without_algorithm_says_how_to_call_it():
    result = subprocess.run(["bash", os.path.join(REPO, "examples", "gpu", "train_1node.sh")],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "ring|ulysses|hybrid" in result.stderr


@pytest.mark.parametrize("algo", ["ring", "ulysses", "hybrid"])
def test_the_moe_launcher_flags_are_valid(algo, monkeypatch):
    """examples/gpu/train_1node.sh with experts (gpt_flags.sh's NUM_EXPERTS): 8 GPUs, CP=4 x
    DP=2, 8 experts over EP=2, as README's MoE line launches it."""
    launcher, flags = dry_run("train_1node.sh", algo, {
        "USE_FLASH_ATTN": "0", "NUM_EXPERTS": "8", "EP_SIZE": "2", "CP_SIZE": "4",
        "ULYSSES_DEGREE": "2"})
    args = validated_argv(monkeypatch, flags, world=8, cuda=True)
    assert (args.context_parallel_size, args.num_experts, args.expert_model_parallel_size,
            args.moe_router_topk) == (4, 8, 2, 2)
    assert args.context_parallel_algo == algo
