"""The GPU session kit on CPU: scripts/gpu_checks.sh's stages still point at tests and tools
that exist and select tests, its budget and failure handling, tools/gpu_env_report.py, and the
offline wheel list's pins (the GPU runs it prepares cannot be run here)."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "gpu_checks.sh")


def checks(*args, env=None, tmp_path=None):
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    if tmp_path is not None:  # no offline wheels, logs in the test's folder
        env.update(OFFLINE_DIR=str(tmp_path / "offline"), GPU_CHECKS_OUT=str(tmp_path / "out"),
                   TMPDIR=str(tmp_path))
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=240)


def stages():
    listed = checks("--list")
    assert listed.returncode == 0, listed.stderr
    return dict(line.split("\t", 1) for line in listed.stdout.splitlines())


# Each stage's pytest arguments collected in ONE fresh interpreter at the repository root (as
# the GPU machine runs them; a pytest subprocess per stage spent seconds importing torch,
# megatron-core and the suite again): prints [exit code, tests selected] per stage.
_COLLECT = """
import json, sys
import pytest

class Selected:
    count = None

    def pytest_collection_finish(self, session):
        self.count = len(session.items)

results = []
for args in json.loads(sys.argv[1]):
    selected = Selected()
    code = pytest.main([*args, "--collect-only", "-q", "-p", "no:cacheprovider"],
                       plugins=[selected])
    results.append([int(code), selected.count])
print("SELECTED", json.dumps(results))
"""


def selected_tests(stage_args):
    """[(exit code, tests selected)] for each list of pytest arguments, in that order."""
    collect = subprocess.run([sys.executable, "-c", _COLLECT, json.dumps(stage_args)], cwd=REPO,
                             capture_output=True, text=True, timeout=240)
    lines = [line for line in collect.stdout.splitlines() if line.startswith("SELECTED ")]
    assert collect.returncode == 0 and lines, collect.stdout[-2000:] + collect.stderr[-2000:]
    return [tuple(result) for result in json.loads(lines[-1].split(" ", 1)[1])], collect.stdout


@pytest.mark.slow
def test_every_stage_runs_a_file_that_exists_and_pytest_stages_select_gpu_tests():
    found = stages()
    assert list(found) == ["env", "kernels", "multiprocess", "training", "bench-cp", "profile",
                           "e2e", "bench-open", "profile-open", "training-open",
                           "bench-default", "magi", "backward-sweep"]
    collecting = {}
    for stage, command in found.items():
        words = shlex.split(command)
        paths = [w.split("=", 1)[-1] for w in words[1:]
                 if w.startswith(("tests", "tools", "--ignore=tests"))]
        assert paths, (stage, command)
        for path in paths:
            assert os.path.exists(os.path.join(REPO, path)), (stage, path)
        if "pytest" in words:
            start = words.index("pytest") + 1
            collecting[stage] = [w for w in words[start:] if w not in ("-s", "-rs")]
    assert list(collecting) == ["kernels", "multiprocess", "training", "training-open"]
    # The single-file stages first: each is then imported fresh, as on the GPU machine.
    order = ["multiprocess", "training", "training-open", "kernels"]
    results, out = selected_tests([collecting[stage] for stage in order])
    for stage, (code, count) in zip(order, results):
        assert code == 0 and count, (stage, code, count, out[-3000:])


def test_the_short_lease_stages_select_the_open_rows_and_their_baselines():
    """bench-open and profile-open (a 15-minute lease's first call) pass the tools an --only
    pattern that, as bash hands it over, keeps our rows with the baselines they are compared
    with, in the same run, and drops what is measured already (reference layouts, steps,
    bench-open: the forced split and the one-call rows)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import bench_cp_gpu
    from bench_selection import wanted

    def selected(stage, names):
        words = shlex.split(stages()[stage])
        only = re.compile(words[words.index("--only") + 1])
        return [name for name in names if wanted(only, name)]

    ours = [name for name, *_ in bench_cp_gpu.our_layouts(steps=False)]
    assert selected("bench-open", bench_cp_gpu.layout_names(steps=False)) == [
        "ideal", *(name for name in ours if "split" not in name),
        "whole row, fused kernel", "whole row, fused kernels fwd+bwd"]
    assert selected("profile-open", [name for name, *_ in bench_cp_gpu.our_layouts()]) == ours


def test_the_backward_sweep_stage_names_shapes_the_tool_takes():
    """A typo in the stage's shapes would cost a lease's call: each parses, none repeats."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import argparse

    import sweep_fused_backward

    words = shlex.split(stages()["backward-sweep"])
    text = words[words.index("--shapes") + 1]
    shapes = sweep_fused_backward.parse_shapes(argparse.ArgumentParser(), text)
    assert len(shapes) == len({(o, k) for _, o, k in shapes}) >= 6
    assert shapes[0][1:] == (((32, 32, 8, 2), False), None)  # the default first
    assert any(atomic for _, (_, atomic), _ in shapes)  # and dq by atomic adds


def test_the_short_lease_stages_run_only_when_named(tmp_path):
    result = checks(env={"GPU_CHECKS_BUDGET": "20"}, tmp_path=tmp_path)
    assert result.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| e2e | not started" in summary and "-open" not in summary


def test_an_unknown_stage_is_refused_naming_the_stages(tmp_path):
    result = checks("kernel", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "unknown stage 'kernel'" in result.stderr and "multiprocess" in result.stderr


def test_a_spent_budget_starts_nothing_and_says_so(tmp_path):
    result = checks("kernels", "e2e", env={"GPU_CHECKS_BUDGET": "20"}, tmp_path=tmp_path)
    assert result.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| kernels | not started: 20s of the budget left | 0 |" in summary
    assert "| e2e | not started" in summary


def test_without_a_gpu_the_env_stage_fails_and_stops_the_rest(tmp_path):
    """The stage's Python stood in for by what tools/gpu_env_report.py says on a machine
    without a GPU (checked below, in this process: a fresh interpreter took 15 s)."""
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\necho 'torch 2.x sees no CUDA device' >&2\nexit 1\n")
    python.chmod(0o755)
    result = checks("env", "kernels", env={"PYTHON": str(python)}, tmp_path=tmp_path)
    assert result.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| env | FAILED (exit 1) |" in summary
    assert "| kernels | not started: the env stage failed | 0 |" in summary
    assert "sees no CUDA device" in (tmp_path / "out" / "env.log").read_text()


def test_a_stage_that_merged_eagerly_is_flagged_in_the_summary(tmp_path):
    """The fused merge's fallback warning (a run that passes, slower) reaches summary.md."""
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\necho 'lse.py:140: UserWarning: fused log-sum-exp merge "
                      "unavailable (FailOnRecompileLimitHit: limit); merging eagerly'\n")
    python.chmod(0o755)
    result = checks("env", env={"PYTHON": str(python)}, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert ("- WARNING: fused log-sum-exp merge unavailable (FailOnRecompileLimitHit: limit); "
            "merging eagerly") in summary


def test_env_report_runs_its_kernel_check_on_cpu(capsys):
    """In this process (the env stage above runs it as a script)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import gpu_env_report

    gpu_env_report.main(["--cpu"])
    out = capsys.readouterr().out
    assert "megatron.core" in out
    assert "one varlen forward+backward on cpu: out (356, 4, 64), finite: True" in out
    if not torch.cuda.is_available():  # what the env stage's failure above stands for
        with pytest.raises(SystemExit, match="sees no CUDA device"):
            gpu_env_report.main([])


def _pins(name):
    pins = {}
    with open(os.path.join(REPO, "requirements", name)) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                package, version = line.split("==")
                pins[package.lower().replace("_", "-")] = version
    return pins


@pytest.mark.parametrize("package", sorted(_pins("offline_gpu.txt")))
def test_offline_wheels_pin_what_the_cpu_environment_pins(package):
    """The GPU machine runs the versions CI tests (each offline wheel pinned in cpu.txt, or,
    for typing-extensions alone, in what cpu.txt's pydantic resolved to)."""
    cpu = _pins("cpu.txt")
    offline = _pins("offline_gpu.txt")
    if package == "typing-extensions":
        import typing_extensions  # noqa: F401 - present in the CPU venv through pydantic
        from importlib.metadata import version
        assert version("typing_extensions") == offline[package]
    else:
        assert cpu.get(package) == offline[package], (package, cpu.get(package))
