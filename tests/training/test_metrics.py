"""--metrics-file (training/metrics.py) under Megatron-LM's trainer. A folder the launch script
never made stopped the last rank alone with a FileNotFoundError traceback after the first
iteration (a helper's soak; the other ranks then reported a lost peer): the folder is made
now, and a path that cannot be written stops every rank at start-up with one line."""

import os

import pytest

from tests.training.megatron_lm_checkout import import_megatron_lm
from tests.training.runs import error_lines, flags, metrics_records, run_ranks, start, start_each

pytestmark = pytest.mark.timeout(240)


def test_a_metrics_file_in_a_new_folder_is_written(short_docs_data, tmp_path):
    import_megatron_lm()
    path = tmp_path / "runs" / "today" / "metrics.jsonl"
    results = run_ranks(start, 2, flags(short_docs_data, path, "--train-iters", "2"),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [0, 0], results
    assert [r["iteration"] for r in metrics_records(path) if "kind" not in r] == [1, 2]


def test_a_metrics_file_that_cannot_be_written_stops_every_rank(short_docs_data, tmp_path):
    import_megatron_lm()
    (tmp_path / "run").write_text("a file where the folder should be")
    path = tmp_path / "run" / "metrics.jsonl"
    results = run_ranks(start, 2, flags(short_docs_data, path), timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    assert error_lines(results) == [[
        f"pretrain_gpt.py: error: --metrics-file {path}: cannot be written (File exists: "
        f"{tmp_path / 'run'})"]] * 2, results
    assert "Traceback" not in results[0][1]


def test_the_flag_given_to_the_last_rank_only(short_docs_data, tmp_path):
    """Log destinations may differ by rank (same_flags), and a script may give the flag to
    its writer only: the first version's check was a collective on the ranks with the flag
    alone (the others went on into the next group's creation: a wait to the timeout)."""
    import_megatron_lm()
    path = str(tmp_path / "new" / "m.jsonl")
    argv = flags(short_docs_data, None, "--train-iters", "2")
    results = run_ranks(start_each, 2, [argv, argv + ["--metrics-file", path]], timeout=240,
                        daemon=False)
    assert [code for code, _ in results] == [0, 0], results
    assert os.path.getsize(path) > 0
