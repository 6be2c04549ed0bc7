"""Before a checkpoint is read (training/checkpoint_preflight.py): the checkpoint --load names,
the same on every rank and whole, or one line naming the flag, the file and the rule, on
every rank (exit 2), where Megatron-LM's trainer failed with tracebacks, hangs, silent fresh
starts, or exit status 0. The checkpoints are Megatron-LM's own, saved by its trainer."""

import argparse
import os
import shutil
import socket

import pytest

from megatron_eod.training.checkpoint_preflight import find_checkpoint
from megatron_eod.training.checkpoint_files import TRACKER, CheckpointError
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import import_megatron_lm
from tests.training.runs import error_lines, flags, metrics_records, start

pytestmark = pytest.mark.timeout(300)


def _save(data, world, *extra):
    """Train the tiny GPT on `world` ranks with `extra` flags; every rank must exit 0."""
    import_megatron_lm()
    results = run_ranks(start, world, flags(data, None, *extra), timeout=240, daemon=False)
    assert [code for code, _ in results] == [0] * world, results


def refused(data, world, *extra):
    """The first rank's one error line of a run every rank of which must stop with exit 2."""
    import_megatron_lm()
    results = run_ranks(start, world, flags(data, None, *extra), timeout=240, daemon=False)
    assert [code for code, _ in results] == [2] * world, results
    lines = error_lines(results)
    assert all(len(said) == 1 for said in lines) and "Traceback" not in results[0][1], results
    return lines[0][0]


@pytest.fixture(scope="module")
def saved(short_docs_data, tmp_path_factory):
    """A torch_dist checkpoint of the tiny GPT at iterations 2 and 4 (one rank)."""
    root = str(tmp_path_factory.mktemp("saved") / "ckpt")
    _save(short_docs_data, 1, "--save", root, "--save-interval", "2")
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    """A copy to damage."""
    return shutil.copytree(saved, str(tmp_path / "ckpt"))


def _args(**values):
    return argparse.Namespace(**{"load": None, "pretrained_checkpoint": None, "finetune": False,
                                 "no_load_optim": False, **values})


def _refused(match, **values):
    with pytest.raises(CheckpointError, match=match) as caught:
        find_checkpoint(_args(**values))
    return str(caught.value)


def test_the_checkpoint_and_a_fresh_start(ckpt, tmp_path):
    found = find_checkpoint(_args(load=ckpt))
    assert (found.iteration, found.format, found.finetune) == (4, "torch_dist", False)
    assert find_checkpoint(_args(load=str(tmp_path / "none"))) is None  # as Megatron-LM
    os.makedirs(tmp_path / "empty")
    assert find_checkpoint(_args(load=str(tmp_path / "empty"))) is None
    assert find_checkpoint(_args(pretrained_checkpoint=ckpt)).finetune
    _refused(r"--load .*empty holds no checkpoint \(no latest_checkpointed_iteration.txt\) and "
             r"--exit-on-missing-checkpoint is set", load=str(tmp_path / "empty"),
             exit_on_missing_checkpoint=True)


@pytest.mark.parametrize("text", ["", "ab", "\x00\x00"])
def test_a_damaged_tracker_resumes_from_the_newest_complete_checkpoint(ckpt, text, capsys):
    """Megatron-LM writes the tracker in place: a kill while it writes leaves it empty (or cut
    short), and its own load exits on it. The newest complete checkpoint is found and the
    tracker rewritten to name it; with none complete, one line naming the flag."""
    tracker = os.path.join(ckpt, TRACKER)
    with open(tracker, "w") as f:
        f.write(text)
    os.makedirs(os.path.join(ckpt, "iter_0000006"))  # a later save killed before its end
    found = find_checkpoint(_args(load=ckpt))
    assert (found.iteration, found.format) == (4, "torch_dist")
    assert open(tracker).read() == "4"
    assert capsys.readouterr().out == (
        f" --load {ckpt}: {TRACKER} held {text.strip()!r}, not an iteration (a save killed "
        f"while writing it): resuming from the newest complete checkpoint, iteration 4, and "
        f"the tracker now names it\n")
    assert not [name for name in os.listdir(ckpt) if ".tmp" in name]


def test_a_damaged_tracker_without_a_complete_checkpoint_names_its_flag(ckpt):
    with open(os.path.join(ckpt, TRACKER), "w") as f:
        f.write("ab")
    tracker = os.path.join(ckpt, TRACKER)
    _refused(rf"^--pretrained-checkpoint {ckpt}: {tracker} holds 'ab'",
             pretrained_checkpoint=ckpt)  # not ours to rewrite
    for name in os.listdir(ckpt):  # no complete checkpoint left
        if name.startswith("iter_"):
            os.remove(os.path.join(ckpt, name, "metadata.json"))
    _refused(rf"^--load {ckpt}: {tracker} holds 'ab', not an iteration \(a save killed while "
             rf"writing it, or a copy cut short\): write the iteration to resume into it$",
             load=ckpt)


def test_a_load_that_cannot_be_a_checkpoint_folder(ckpt, tmp_path):
    (tmp_path / "file").write_text("x")
    _refused(r"--load .*file is a file, not a checkpoint folder", load=str(tmp_path / "file"))
    _refused(rf"^--load {ckpt}/iter_0000004 is one iteration's folder: give the folder holding "
             rf"it and {TRACKER}, {ckpt}$", load=os.path.join(ckpt, "iter_0000004"))


def test_checkpoints_without_their_tracker_are_not_overwritten(ckpt):
    """A fresh start there trained from scratch and replaced them at the first save (both
    trainers; a helper's run: the relaunch wrote iteration 2 over the old run's)."""
    os.remove(os.path.join(ckpt, TRACKER))
    _refused(rf"^--load {ckpt} holds checkpoints \(the newest: iteration 4\) but no {TRACKER}: "
             rf"a fresh start would train from scratch and overwrite them. Write the iteration "
             rf"to resume into it \(echo 4 > {ckpt}/{TRACKER}\), or give another --load$",
             load=ckpt)
    for name in ("iter_0000002", "iter_0000004"):  # a first save killed early: nothing whole
        os.remove(os.path.join(ckpt, name, "metadata.json"))
    assert find_checkpoint(_args(load=ckpt)) is None


def test_a_first_save_killed_early_starts_fresh(tmp_path):
    """A torch-format save killed before its files were written leaves mp_rank_* folders
    without them (or with a `.tmp`): not a checkpoint to protect, a fresh start (as before,
    and as Megatron-LM)."""
    root = tmp_path / "ckpt"
    for name in ("mp_rank_00", "mp_rank_01"):
        (root / "iter_0000003" / name).mkdir(parents=True)
    (root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt.tmp").write_bytes(b"PK")
    assert find_checkpoint(_args(load=str(root))) is None


def test_a_torch_format_save_killed_midway_starts_fresh(tmp_path, capsys):
    """A soak's kill -9 of one rank in the first save (torch format, distributed optimizer)
    left a model file without the optimizer's and no tracker: every relaunch was refused, and
    the advice (write 3 into the tracker) led to a refusal naming the missing file.
    Megatron-LM writes the optimizer's file first (`test_megatron_lm_saves_the_optimizer_first`
    below): a folder is whole with every mp_rank_* folder's model file and the optimizer's in all or
    none (none: a save with --no-save-optim, which a fresh start must not overwrite)."""
    root = tmp_path / "ckpt"
    ranks = [root / "iter_0000003" / name for name in ("mp_rank_00", "mp_rank_01")]
    for rank in ranks:
        rank.mkdir(parents=True)
    (ranks[0] / "distrib_optim.pt").write_bytes(b"PK")  # killed before the model files
    reads = dict(load=str(root), use_distributed_optimizer=True)
    assert find_checkpoint(_args(**reads)) is None
    assert capsys.readouterr().out == (
        f" --load {root}: no {TRACKER} and no whole checkpoint (iter_0000003: left by a save "
        f"stopped before its end, which the save of that iteration replaces): training from "
        f"scratch\n")
    for rank in ranks:
        (rank / "model_optim_rng.pt").write_bytes(b"PK")
    assert find_checkpoint(_args(**reads)) is None  # the optimizer's in one folder only
    (ranks[0] / "distrib_optim.pt").unlink()  # in none: --no-save-optim, whole
    _refused(r"holds checkpoints \(the newest: iteration 3\) but no", **reads)
    for rank in ranks:
        (rank / "distrib_optim.pt").write_bytes(b"PK")
    _refused(r"holds checkpoints \(the newest: iteration 3\) but no", **reads)


def _saves_the_optimizer_first(rank, world, argv):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    seen = []
    original = DistributedOptimizer.save_parameter_state

    def save_parameter_state(self, filename):
        seen.append(os.path.exists(os.path.join(os.path.dirname(filename),
                                                "model_optim_rng.pt")))
        return original(self, filename)

    DistributedOptimizer.save_parameter_state = save_parameter_state
    try:
        return start(rank, world, argv)[0], seen
    finally:
        DistributedOptimizer.save_parameter_state = original


def test_megatron_lm_saves_the_optimizer_first(short_docs_data, tmp_path):
    """What `is_whole` reads a torch-format folder by: its model file written last."""
    import_megatron_lm()
    argv = flags(short_docs_data, None, "--ckpt-format", "torch", "--train-iters", "2",
                 "--save", str(tmp_path / "ckpt"))
    assert run_ranks(_saves_the_optimizer_first, 1, argv, timeout=240,
                     daemon=False) == [(0, [False])]


def test_megatron_lm_ckpt_step_names_the_iteration(ckpt):
    """Megatron-LM's --ckpt-step loads that iteration, whatever the tracker says (or without
    one): a damaged newer checkpoint is stepped over."""
    folder = os.path.join(ckpt, "iter_0000004")
    os.remove(os.path.join(folder, "metadata.json"))
    os.remove(os.path.join(ckpt, TRACKER))
    assert find_checkpoint(_args(load=ckpt, ckpt_step=2)).iteration == 2
    _refused(rf"--ckpt-step 3 names iteration 3 but {ckpt}/iter_0000003 holds no complete "
             rf"checkpoint", load=ckpt, ckpt_step=3)


def test_a_link_to_nowhere_and_a_torch_dist_folder_without_its_metadata(ckpt, tmp_path):
    os.symlink(str(tmp_path / "unmounted" / "ckpt"), str(tmp_path / "link"))
    _refused(rf"--load {tmp_path}/link is a link to {tmp_path}/unmounted/ckpt, which does not "
             rf"exist \(a file system not mounted on this node\?\)", load=str(tmp_path / "link"))
    folder = os.path.join(ckpt, "iter_0000004")
    os.remove(os.path.join(folder, "metadata.json"))
    if os.path.exists(os.path.join(folder, "common.pt")):  # megatron-core <= 0.16's layout
        _refused(rf"{folder} is a torch_dist checkpoint without its metadata.json", load=ckpt)
    else:  # .metadata alone: another format's (torch_dcp, fsdp_dtensor), Megatron-LM's to read
        assert find_checkpoint(_args(load=ckpt)).format == "other"


def test_an_iteration_without_a_checkpoint_names_the_complete_ones(ckpt):
    shutil.rmtree(os.path.join(ckpt, "iter_0000004"))
    _refused(rf"names iteration 4 but {ckpt}/iter_0000004 holds no complete checkpoint \(no "
             rf"metadata.json, no mp_rank_\*\); complete there: iteration 2 \(write one into "
             rf"{TRACKER} to resume from it\)$", load=ckpt)


@pytest.mark.parametrize("damage, said", [
    ("metadata.json=garbage", r"metadata.json cannot be read as the checkpoint's JSON metadata"),
    ("common.pt=cut", r"common.pt is damaged or cut short \(the checkpoint's args"),
    ("common.pt=empty", r"common.pt is empty"),
    ("common.pt=missing", r"its common state \(args, iteration, schedule\) cannot be read"),
    (".metadata=missing", r"\.metadata \(the index of the checkpoint's shards\) is missing or "
                          r"damaged"),
    (".metadata=cut", r"\.metadata \(the index of the checkpoint's shards\) is missing or "
                      r"damaged"),
    ("shard=missing", r"__0_0.distcp is missing or cannot be read \(No such file or directory; "
                      r"one of the \d+ shard files the checkpoint lists; a checkpoint saved to "
                      r"node-local disks holds on each node its own ranks' shards only\)"),
    ("shard=cut", r"__0_0.distcp is cut short: \d+ bytes, where the checkpoint lists data up to "
                  r"byte \d+$"),
])
def test_a_damaged_torch_dist_checkpoint_is_named(ckpt, damage, said):
    """Each was a traceback deep in megatron-core or torch (79 lines for a missing shard),
    several naming no file."""
    name, how = damage.split("=")
    folder = os.path.join(ckpt, "iter_0000004")
    if name == "common.pt" and not os.path.exists(os.path.join(folder, name)):
        pytest.skip("megatron-core >= 0.17 keeps the common state inside the shards")
    if name == "shard":
        name = min(n for n in os.listdir(folder) if n.endswith(".distcp"))
    path = os.path.join(folder, name)
    if how == "missing":
        os.remove(path)
    elif how == "garbage":
        with open(path, "w") as f:
            f.write("{not json")
    else:
        os.truncate(path, 0 if how == "empty" else os.path.getsize(path) // 2)
    _refused(rf"^--load {ckpt}: {folder}.*{said}", load=ckpt)


def test_a_checkpoint_without_its_optimizer_state_resumes_only_when_asked(short_docs_data,
                                                                          tmp_path):
    root = str(tmp_path / "ckpt")
    _save(short_docs_data, 1, "--train-iters", "3", "--save", root, "--no-save-optim")
    _refused(r"iteration 3 was saved without its optimizer state \(--no-save-optim\)",
             load=root)
    for asked in ({"no_load_optim": True}, {"finetune": True}):
        assert find_checkpoint(_args(load=root, **asked)).iteration == 3


def _find(rank, world, roots):
    try:
        find_checkpoint(_args(load=roots[rank]))
    except CheckpointError as error:
        return str(error)
    return None


def test_ranks_reading_different_checkpoints_stop_every_rank(ckpt, tmp_path):
    """Node-local copies, one stale: rank 0 resumed at iteration 4 and rank 1 at 2, both
    trained on, then stopped at a collective mismatch."""
    stale = shutil.copytree(ckpt, str(tmp_path / "stale"))
    with open(os.path.join(stale, TRACKER), "w") as f:
        f.write("2")
    assert run_ranks(_find, 2, [ckpt, ckpt]) == [None, None]
    errors = run_ranks(_find, 3, [ckpt, ckpt, stale])
    host = socket.gethostname()
    assert errors == [errors[0]] * 3 and errors[0] == (
        f"--load: the ranks read different checkpoints: rank 0 ({host}) iteration 4 of "
        f"{ckpt}, rank 2 ({host}) iteration 2 of {stale} (1 of 3 ranks differ from rank 0). "
        f"Every rank must read the same checkpoint: a shared file system, or node-local copies "
        f"kept in step")
    with open(os.path.join(stale, TRACKER), "w") as f:
        f.write("x")  # found on one rank only: named with its rank
    shutil.rmtree(os.path.join(stale, "iter_0000002"))  # (with none complete there)
    shutil.rmtree(os.path.join(stale, "iter_0000004"))
    errors = run_ranks(_find, 2, [ckpt, stale])
    assert errors == [errors[0]] * 2 and errors[0].startswith(
        f"rank 1 ({host}): --load {stale}: {stale}/{TRACKER} holds 'x'")


def test_a_cut_shard_stops_every_rank_with_one_line(short_docs_data, ckpt):
    folder = os.path.join(ckpt, "iter_0000004")
    shard = os.path.join(folder, min(n for n in os.listdir(folder) if n.endswith(".distcp")))
    os.truncate(shard, 100)
    line = refused(short_docs_data, 2, "--context-parallel-size", "2", "--train-iters", "6",
                   "--load", ckpt)
    assert line.startswith(f"pretrain_gpt.py: error: --load {ckpt}: {shard} is cut short: "
                           f"100 bytes")  # every rank, no rank named: rank 0 read the index


def test_one_ranks_damaged_torch_format_file_stops_every_rank(short_docs_data, tmp_path):
    """TP=2, --ckpt-format torch: rank 1's file cut short was a traceback there while rank 0
    waited in the load's barrier (under NCCL until --distributed-timeout-minutes)."""
    root = str(tmp_path / "ckpt")
    tp2 = ("--tensor-model-parallel-size", "2", "--ckpt-format", "torch",
           "--make-vocab-size-divisible-by", "64")
    _save(short_docs_data, 2, *tp2, "--train-iters", "2", "--save", root)
    path = os.path.join(root, "iter_0000002", "mp_rank_01", "model_optim_rng.pt")
    os.truncate(path, os.path.getsize(path) - 100)
    line = refused(short_docs_data, 2, *tp2, "--train-iters", "4", "--load", root)
    assert line.startswith(f"pretrain_gpt.py: error: rank 1 ({socket.gethostname()}): --load "
                           f"{root}: {path} is damaged or cut short (this rank's part of the "
                           f"checkpoint: "), line


def test_an_empty_tracker_resumes_and_a_damaged_index_stops_every_rank(short_docs_data, ckpt,
                                                                        tmp_path):
    """Megatron-LM's load exited 0 after `ERROR: Invalid metadata file` (a job scheduler reads
    success; Megatron-LM writes the tracker in place, so a kill while it writes leaves it
    empty): the run resumes from the newest complete checkpoint now and trains on from it. A
    damaged index: one line, exit 2."""
    metrics = tmp_path / "resumed.jsonl"
    tracker = os.path.join(ckpt, TRACKER)
    open(tracker, "w").close()
    import_megatron_lm()
    results = run_ranks(start, 2, flags(short_docs_data, str(metrics), "--load", ckpt,
                                        "--train-iters", "6",
                                        "--use-checkpoint-opt_param-scheduler"),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [0, 0], results
    assert [r["iteration"] for r in metrics_records(metrics) if "kind" not in r] == [5, 6]
    assert open(tracker).read() == "4"
    with open(tracker, "w") as f:
        f.write("4")
    os.remove(os.path.join(ckpt, "iter_0000004", ".metadata"))
    line = refused(short_docs_data, 2, "--load", ckpt)
    assert "(the index of the checkpoint's shards) is missing or damaged" in line, line


def test_megatron_lm_exiting_in_its_load_exits_2(short_docs_data, tmp_path):
    """A torch-format file missing: Megatron-LM's load prints `could not load the checkpoint`
    and calls sys.exit() (status 0); a line and status 2 now."""
    root = str(tmp_path / "ckpt")
    _save(short_docs_data, 1, "--ckpt-format", "torch", "--train-iters", "2", "--save", root)
    os.remove(os.path.join(root, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))
    line = refused(short_docs_data, 2, "--load", root)
    assert line.startswith(f"pretrain_gpt.py: error: --load {root}: Megatron-LM's "
                           f"load_checkpoint stopped the run (its message above says why"), line


def test_a_damaged_optimizer_file_blocks_only_the_loads_that_read_it(short_docs_data, tmp_path):
    """--no-load-optim and --finetune salvage the weights of a checkpoint whose distributed
    optimizer file was cut short; a resume that reads it is refused by name."""
    root = str(tmp_path / "ckpt")
    torch_format = ("--ckpt-format", "torch")
    _save(short_docs_data, 1, *torch_format, "--train-iters", "2", "--save", root)
    path = os.path.join(root, "iter_0000002", "mp_rank_00", "distrib_optim.pt")
    os.truncate(path, os.path.getsize(path) // 2)
    line = refused(short_docs_data, 1, *torch_format, "--load", root)
    assert f"--load {root}: {path} is damaged or cut short (the distributed optimizer's " \
           f"state: " in line, line
    for salvage in ("--no-load-optim", "--finetune"):
        _save(short_docs_data, 1, *torch_format, "--load", root, salvage)


def test_exit_on_missing_checkpoint_stops_instead_of_training_from_scratch(short_docs_data,
                                                                           tmp_path):
    """Megatron-LM's own --exit-on-missing-checkpoint printed a line and exited 0, which a job
    scheduler reads as success; one line and exit 2 now."""
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused(short_docs_data, 2, "--load", str(empty), "--exit-on-missing-checkpoint")
    assert line == (f"pretrain_gpt.py: error: --load {empty} holds no checkpoint (no {TRACKER}) "
                    f"and --exit-on-missing-checkpoint is set: stopping instead of training "
                    f"from scratch")
