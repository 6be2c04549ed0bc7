"""tools/loss_table.py, which the README main job ends with: agreeing runs pass, a run off by
more than the tolerance or missing an iteration fails, unreadable input is a usage error."""

import json
import os
import runpy

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "loss_table.py")
main = runpy.run_path(TOOL)["main"]


def metrics(tmp_path, name, losses, extra=()):
    path = tmp_path / f"{name}.jsonl"
    records = [{"iteration": i + 1, "lm_loss": x, "lr": 1e-3} for i, x in enumerate(losses)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*records, *extra]))
    return f"{name}={path}"


def test_agreeing_runs_pass_and_validation_lines_are_ignored(tmp_path, capsys):
    a = metrics(tmp_path, "cp1", [5.0, 4.0, 3.0], [{"kind": "valid", "iteration": 3,
                                                    "lm_loss": 9.0}])
    b = metrics(tmp_path, "ring", [5.0, 4.00001, 3.0])
    assert main([a, b, "--tolerance", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "4.000010" in out and "within 1e-05" in out


def test_a_run_off_by_more_than_the_tolerance_fails(tmp_path, capsys):
    a = metrics(tmp_path, "cp1", [5.0, 4.0])
    b = metrics(tmp_path, "ring", [5.0, 4.001])
    assert main([a, b]) == 1
    assert "NOT within" in capsys.readouterr().out


def test_a_missing_iteration_fails(tmp_path):
    assert main([metrics(tmp_path, "cp1", [5.0, 4.0]), metrics(tmp_path, "ring", [5.0])]) == 1


@pytest.mark.parametrize("arg", ["no-equals-sign", "cp1=/nonexistent/metrics.jsonl"])
def test_bad_arguments_are_usage_errors(arg, capsys):
    with pytest.raises(SystemExit) as stop:
        main([arg])
    assert stop.value.code == 2
    assert "error" in capsys.readouterr().err


def test_a_line_that_is_not_json_is_named(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"iteration": 1, "lm_loss": 5.0}\nnot json\n')
    with pytest.raises(SystemExit):
        main([f"cp1={path}"])
    assert f"{path}:2" in capsys.readouterr().err


def test_a_diverged_run_agrees_with_nothing(tmp_path):
    """(A NaN loss passed as 0.0 apart, even NaN against NaN: a tools sweep.)"""
    nan = float("nan")
    assert main([metrics(tmp_path, "cp1", [5.0, 4.0]),
                 metrics(tmp_path, "ring", [5.0, nan])]) == 1
    assert main([metrics(tmp_path, "a", [nan]), metrics(tmp_path, "b", [nan])]) == 1
    assert main([metrics(tmp_path, "c", [float("inf")]), metrics(tmp_path, "d", [5.0])]) == 1


@pytest.mark.parametrize("line,said", [
    (b'{"lm_loss": 5.0}\n', r'\.jsonl:1: "iteration" must be an integer, got None'),
    (b'[1, 2]\n', r"\.jsonl:1: not a --metrics-file record"),
    (b'{"iteration": 1, "lm_loss": null}\n', r'"lm_loss" must be a number, got None'),
    (b'{"iteration": 1, "lm_loss": "abc"}\n', r"\"lm_loss\" must be a number, got 'abc'"),
    (b'{"iteration": "x", "lm_loss": 5.0}\n', r'"iteration" must be an integer'),
    (b'\xff\xfe\n', r"bad\.jsonl: not UTF-8 text"),
])
def test_a_malformed_line_is_named_by_file_and_line(tmp_path, capsys, line, said):
    """(Each was a traceback or a message naming no file: a tools sweep.)"""
    import re

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(line)
    with pytest.raises(SystemExit) as stop:
        main([metrics(tmp_path, "cp1", [5.0]), f"bad={bad}"])
    assert stop.value.code == 2 and re.search(said, capsys.readouterr().err)


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf"])
def test_a_tolerance_must_be_finite_and_not_negative(tmp_path, capsys, tolerance):
    with pytest.raises(SystemExit) as stop:
        main([metrics(tmp_path, "cp1", [5.0]), "--tolerance", tolerance])
    assert stop.value.code == 2 and "--tolerance must be a finite number >= 0" in \
        capsys.readouterr().err
