"""--metrics-file's folder at start-up (training/metrics_file.py), both trainers. A folder the
launch script never made stopped the last rank alone with a FileNotFoundError traceback after
the first iteration (a helper's soak; the other ranks then reported a lost peer): the folder is
made now, and a path that cannot be written stops every rank at start-up with one line."""

import json
import os

import pytest

from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train

pytestmark = pytest.mark.timeout(240)


def _lines(results):
    return [[line for line in text.splitlines() if line.startswith("pretrain_gpt.py: error:")]
            for _, text, *_ in results]


def test_a_metrics_file_in_a_new_folder_is_written(tiny_data, tmp_path):
    path = tmp_path / "runs" / "today" / "metrics.jsonl"
    results = run_ranks(_train, 2, tiny_flags(tiny_data, "--train-iters", "3",
                                              "--metrics-file", str(path)))
    assert [code for code, *_ in results] == [0, 0], results
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in records if "kind" not in r] == [1, 2, 3], records


def test_a_metrics_file_that_cannot_be_written_stops_every_rank(tiny_data, tmp_path):
    (tmp_path / "run").write_text("a file where the folder should be")
    path = tmp_path / "run" / "metrics.jsonl"
    results = run_ranks(_train, 2, tiny_flags(tiny_data, "--metrics-file", str(path)))
    assert [code for code, *_ in results] == [2, 2], results
    lines = _lines(results)
    assert lines[0] == lines[1] == [
        f"pretrain_gpt.py: error: --metrics-file {path}: cannot be written (File exists: "
        f"{tmp_path / 'run'})"], results


def test_megatron_lm_trainer_stops_every_rank_too(short_docs_data, tmp_path):
    from tests.training.megatron_lm_checkout import import_megatron_lm
    from tests.training.test_megatron_lm_pretrain import _start, flags

    import_megatron_lm()
    (tmp_path / "run").write_text("x")
    path = os.path.join(tmp_path, "run", "m.jsonl")
    results = run_ranks(_start, 2, flags(short_docs_data, path), timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    for _, text in results:
        assert f"pretrain_gpt.py: error: --metrics-file {path}: cannot be written" in text \
            and "Traceback" not in text, text[-2000:]


def _train_flag_on_last_rank(rank, world, argv, path):
    return _train(rank, world, argv + (["--metrics-file", path] if rank == world - 1 else []))


def test_the_flag_given_to_the_last_rank_only(tiny_data, tmp_path):
    """Log destinations may differ by rank (same_flags), and a script may give the flag to
    its writer only: the first version's check was a collective on the ranks with the flag
    alone (the others went on into the next group's creation: a wait to the timeout)."""
    path = str(tmp_path / "new" / "m.jsonl")
    results = run_ranks(_train_flag_on_last_rank, 2,
                        tiny_flags(tiny_data, "--train-iters", "3"), path)
    assert [code for code, *_ in results] == [0, 0], results
    assert os.path.getsize(path) > 0
