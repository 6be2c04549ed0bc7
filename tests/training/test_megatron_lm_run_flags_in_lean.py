"""Megatron-LM's run-time switches in the lean trainer: --exit-signal-handler saves and stops
every rank when any one is signalled, --manual-gc collects where Megatron-LM's loop does and
gives the collector back, --empty-unused-memory-level releases the CUDA cache where asked,
and the log's optional fields (--log-params-norm, --log-num-zeros-in-grad, --log-throughput)
are right at any TP/PP/CP split."""

import json
import signal

import pytest
import torch

from megatron_eod.training import run_controls
from megatron_eod.training.args import parse_args
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train


def _signalled_at_iteration_2(rank, world, argv):
    """Rank 1 gets SIGUSR1 during its second iteration; the handler is put back after."""
    import os

    from megatron_eod.training import pretrain as module

    step = module._Trainer._train_step

    def train_step(self):
        if rank == 1 and self.iteration == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(self)

    module._Trainer._train_step = train_step
    before = signal.getsignal(signal.SIGUSR1)
    result = _train(rank, world, argv)
    return (*result, signal.getsignal(signal.SIGUSR1) is before)


def test_a_signal_to_one_rank_saves_and_stops_every_rank(tiny_data, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_flags(tiny_data, "--context-parallel-size", "2", "--save", str(save),
                      "--save-interval", "100", "--exit-signal-handler", "--exit-signal",
                      "SIGUSR1", "--use-mcore-models", "--timing-log-level", "2")
    results = run_ranks(_signalled_at_iteration_2, 2, argv, daemon=False)  # saving forks
    assert [code for code, *_ in results] == [0, 0], results
    assert [len(losses) for _, _, losses, _ in results] == [2, 2]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    out = results[0][1]
    assert "exiting after receiving SIGUSR1 (--exit-signal-handler)" in out
    assert ("accepted, with no effect in the lean trainer: --use-mcore-models (megatron-core's "
            "GPTModel is the only model here") in out and "--timing-log-level (a report" in out
    assert all(restored for *_, restored in results)


class _Collections:
    def __init__(self):
        self.calls, self.enabled_during_run = 0, []

    def collect(self, generation=2):
        self.calls += 1


def _count_collections(rank, world, argv):
    from megatron_eod.training import pretrain as module

    counted = _Collections()
    real_gc = run_controls.gc

    class Gc:  # the module's gc, collections counted
        disable, enable, isenabled = real_gc.disable, real_gc.enable, real_gc.isenabled
        collect = staticmethod(counted.collect)

    run_controls.gc = Gc
    step = module._Trainer._train_step

    def train_step(self):
        counted.enabled_during_run.append(real_gc.isenabled())
        return step(self)

    module._Trainer._train_step = train_step
    code, text, _ = _train(rank, world, argv)
    return code, counted.calls, counted.enabled_during_run, real_gc.isenabled()


@pytest.mark.parametrize("flags,collections", [
    # one at the start, at iterations 2 and 4; none around the final evaluations
    (["--manual-gc", "--manual-gc-interval", "2"], 1 + 2),
    # and before and after the loop's evaluations at iterations 2 and 4 (the last one too,
    # as Megatron-LM's loop)
    (["--manual-gc", "--manual-gc-interval", "2", "--eval-interval", "2"], 1 + 2 + 2 * 2),
    (["--manual-gc", "--manual-gc-interval", "2", "--eval-interval", "2",
      "--no-manual-gc-eval"], 1 + 2),
    (["--manual-gc"], 1),
    ([], 0),
])
def test_manual_gc_collects_where_megatron_lm_does(tiny_data, flags, collections):
    argv = tiny_flags(tiny_data, "--train-iters", "4", "--eval-interval", "1000", *flags)
    ((code, calls, enabled, after),) = run_ranks(_count_collections, 1, argv)
    assert code == 0 and calls == collections
    assert enabled == ["--manual-gc" not in flags] * 4 and after


@pytest.mark.parametrize("level,releases", [(0, 0), (1, 1), (2, 2)])
def test_empty_unused_memory_level(monkeypatch, level, releases):
    released = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(1))
    args = parse_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                       "--seq-length", "8", "--train-iters", "1", "--lr", "1", "--mock-data",
                       "--empty-unused-memory-level", str(level)],
                      world_size=1, cuda_available=False)
    controls = run_controls.RunControls(args)
    controls.after_forward_backward()  # level >= 1, as Megatron-LM's train_step
    controls.after_step(1)             # level 2
    controls.close()
    assert len(released) == releases


def _logged(rank, world, argv):
    code, text, losses = _train(rank, world, argv)
    return code, text


@pytest.mark.parametrize("split,rel", [
    # TP: the padded vocabulary kept the same (a multiple of 128 x TP otherwise)
    (["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"], 1e-5),
    # PP: the second stage draws its layers from its own seed (as Megatron-LM's), so the
    # weights differ by chance; the shared embedding counted twice would add 1.4 %
    (["--pipeline-model-parallel-size", "2"], 1e-3),
    (["--context-parallel-size", "2"], 1e-5)], ids=["tp2", "pp2", "cp2"])
def test_params_norm_counts_each_weight_once_at_any_split(tiny_data, tmp_path, split, rel):
    """The norm after each step, one rank against two. CPU initialisation makes whole
    matrices, then splits them: TP and CP runs start from the same weights, and their steps
    agree to float32 round-off. Counting TP duplicates (the layer norms: most of this tiny
    model's norm) or the last stage's copy of the shared embedding gives another number."""
    norms = {}
    for name, flags in (("one", []), ("split", split)):
        metrics = tmp_path / f"{name}.jsonl"
        argv = tiny_flags(tiny_data, "--train-iters", "3", "--log-params-norm",
                          "--log-num-zeros-in-grad", "--log-throughput", "--metrics-file",
                          str(metrics), "--log-interval", "1", *flags)
        results = run_ranks(_logged, 1 if name == "one" else 2, argv)
        assert all(code == 0 for code, _ in results), results
        assert "params norm: " in results[-1][1] and "num zeros: " in results[-1][1]
        assert "throughput per GPU (TFLOP/s/GPU): " in results[-1][1]
        records = [json.loads(line) for line in metrics.read_text().splitlines()
                   if "kind" not in json.loads(line)]
        norms[name] = [r["params_norm"] for r in records]
        assert all(r["num_zeros_in_grad"] >= 0 and r["model_tflops_per_gpu"] > 0
                   for r in records)
    assert norms["split"] == pytest.approx(norms["one"], rel=rel)
    assert norms["one"][0] != norms["one"][1]  # it follows the weights


def test_params_norm_is_the_norm_of_every_weight_once(tiny_data):
    (norm_and_direct,) = run_ranks(_norm_and_direct, 1, tiny_flags(tiny_data))
    assert norm_and_direct[0] == pytest.approx(norm_and_direct[1], rel=1e-6)


def _norm_and_direct(rank, world, argv):
    from megatron_eod.megatron.batch_context import EodContextRegistry
    from megatron_eod.training.model import build_model
    from megatron_eod.training.model_stats import params_norm
    from tests.megatron.tiny_model import cp_setup

    args = parse_args(argv, world_size=1, cuda_available=False)
    with cp_setup(1):
        (model,), _ = build_model(args, EodContextRegistry(), 256)
        direct = sum(p.double().pow(2).sum() for p in model.parameters()).sqrt().item()
        return params_norm([model]), direct


def _orphan_signalled(pipe):
    """A worker whose launcher died gets parent_watch's SIGTERM: it must die of it, not keep
    training towards a save its dead peers never join."""
    import os

    args = parse_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                       "--seq-length", "8", "--train-iters", "1", "--lr", "1", "--mock-data",
                       "--exit-signal-handler", "--exit-signal", "SIGUSR1"],
                      world_size=1, cuda_available=False)
    controls = run_controls.RunControls(args)
    os.kill(os.getpid(), signal.SIGUSR1)  # the launcher is alive: remembered
    pipe.send(controls.signal_received())
    controls.parent = -1                  # as if re-parented: the launcher is gone
    os.kill(os.getpid(), signal.SIGUSR1)
    pipe.send("still alive")


def test_the_exit_signal_of_an_orphan_still_ends_it():
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_orphan_signalled, args=(theirs,))
    child.start()
    child.join(60)
    assert ours.poll(5) and ours.recv() is True
    assert child.exitcode == -signal.SIGUSR1 and not ours.poll(0)


def test_params_norm_sees_this_steps_weights_with_overlapped_gathers(tiny_data, tmp_path):
    """--overlap-param-gather gathers the distributed optimizer's updated shards only at the
    next forward: a norm taken right after the step mixed this step's shard with the other
    ranks' previous ones (19.095 against 19.246)."""
    norms, losses = [], []
    for name, flags in (("sync", ["--log-params-norm"]),
                        ("overlap", ["--log-params-norm", "--overlap-param-gather"]),
                        ("unlogged", ["--overlap-param-gather"])):
        metrics = tmp_path / f"{name}.jsonl"
        argv = tiny_flags(tiny_data, "--train-iters", "3", "--use-distributed-optimizer",
                          "--metrics-file", str(metrics), *flags)
        assert all(code == 0 for code, _ in run_ranks(_logged, 2, argv))
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        norms.append([r.get("params_norm") for r in records if "kind" not in r])
        losses.append([r["lm_loss"] for r in records])
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)
    assert losses[0] == losses[1] == losses[2]  # the extra gather changes no step


def test_exit_on_missing_checkpoint_stops_instead_of_training_from_scratch(tiny_data, tmp_path):
    """A continuation job whose --load is empty (a wrong path, a lost checkpoint) would train a
    new model from scratch under the old run's name."""
    from megatron_eod.training.args import FlagError
    from tests.training.test_checkpoint_formats import refused

    empty = tmp_path / "ckpt"
    empty.mkdir()
    line = refused(2, tiny_data, "--context-parallel-size", "2", "--load", str(empty),
                   "--exit-on-missing-checkpoint")
    assert line == (f"pretrain_gpt.py: error: --load {empty} holds no checkpoint (no "
                    f"latest_checkpointed_iteration.txt) and --exit-on-missing-checkpoint is "
                    f"set: stopping instead of training from scratch")
    with pytest.raises(FlagError, match="--exit-on-missing-checkpoint needs --load DIR"):
        parse_args(tiny_flags(tiny_data, "--exit-on-missing-checkpoint"), world_size=1,
                   cuda_available=False)
