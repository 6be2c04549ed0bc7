"""Checkpoints do not pile up and a save killed midway leaves nothing behind for long:
`--save-keep-last N` keeps the newest N whole checkpoints (and removes killed saves' folders); what a kill during a save leaves (a
partial iteration folder the tracker does not name, a tracker `.tmp`) is replaced by the next
save, and the run resumes from the last complete checkpoint."""

import os

from megatron_eod.training.checkpoint_files import _prune
from tests.functional.test_cpu_training import train


def iterations(root):
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_"))


def test_keep_last_prunes_old_checkpoints(tiny_data, tmp_path):
    save = str(tmp_path / "ckpt")
    train(2, tiny_data, "--context-parallel-size", "2", "--save", save, "--save-interval", "2",
          "--save-keep-last", "2")
    assert iterations(save) == [8, 10]
    everything = str(tmp_path / "all")
    train(2, tiny_data, "--context-parallel-size", "2", "--save", everything,
          "--save-interval", "4")
    assert iterations(everything) == [4, 8, 10]  # the default keeps all, as Megatron-LM


def test_a_save_killed_midway_is_replaced_and_the_run_resumes(tiny_data, tmp_path):
    save = str(tmp_path / "ckpt")
    first = train(2, tiny_data, "--context-parallel-size", "2", "--save", save,
                  "--exit-interval", "4")
    # What a kill during the next save leaves: a partial iteration folder and tracker.
    partial = os.path.join(save, "iter_0000010", "__0_0.distcp")
    os.makedirs(os.path.dirname(partial))
    for path in (partial, os.path.join(save, "latest_checkpointed_iteration.txt.tmp")):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
    rest = train(2, tiny_data, "--context-parallel-size", "2", "--load", save, "--save", save)
    assert len(first) == 4 and len(rest) == 6
    leftovers = [name for _, _, files in os.walk(save) for name in files if name.endswith(".tmp")]
    assert leftovers == []
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "10"
    with open(partial, "rb") as f:
        assert f.read() != b"half a checkpoint"


def test_save_keep_last_keeps_whole_checkpoints_and_drops_partial_ones(tmp_path):
    """A soak's killed save left iter_0000009 with common.pt only; --save-keep-last 2 after
    the resume counted it and removed the whole iteration 8: one whole checkpoint kept, the
    partial folder never removed."""
    root = tmp_path / "ckpt"
    for iteration in (3, 6, 8, 12):
        (root / f"iter_{iteration:07d}").mkdir(parents=True)
        (root / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")
    (root / "iter_0000009").mkdir()
    (root / "iter_0000009" / "common.pt").write_bytes(b"PK")
    _prune(str(root), 2, 12)
    assert sorted(os.listdir(root)) == ["iter_0000008", "iter_0000012"]
    _prune(str(root), 5, 12)  # fewer than asked for: all kept
    assert sorted(os.listdir(root)) == ["iter_0000008", "iter_0000012"]
    # A folder it cannot tell from another format's checkpoint (torch_dcp: .metadata, no
    # metadata.json) stays, whatever its iteration; a torch-format save killed midway goes.
    (root / "iter_0000020").mkdir()
    (root / "iter_0000020" / ".metadata").write_bytes(b"x")
    (root / "iter_0000020" / "__0_0.distcp").write_bytes(b"x")
    (root / "iter_0000014" / "mp_rank_00").mkdir(parents=True)
    (root / "iter_0000014" / "mp_rank_00" / "distrib_optim.pt").write_bytes(b"PK")
    _prune(str(root), 1, 12)
    assert sorted(os.listdir(root)) == ["iter_0000012", "iter_0000020"]
