"""tools/bench_cp_gpu.py runs on the CPU at a small size (the GPU session relies on it): every
mix prints the eleven layouts with forward, backward and both on the wall clock, both on the
device-only clock, the tile floor, and the ideal row is 1.00 on each."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import bench_cp_gpu  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_eod import plan_context_parallel  # noqa: E402


def _rows(capsys):
    out = capsys.readouterr().out
    return [line.split(" | ") for line in out.splitlines() if line.startswith("| ")
            and not line.startswith("| layout")]


def test_small_cpu_run_prints_every_layout_fwd_bwd(capsys):
    # The fused rows apart (below): Triton's interpreter is slow at this size.
    bench_cp_gpu.main(["--samples", "1", "--repeats", "1", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16", "--configs", "1024:4", "--steps",
                       "--only", "^(?!.*fused)"])
    rows = _rows(capsys)
    assert [r[0] for r in rows] == ["| " + name for name in (
        "ideal", "ours ring", "ours ring (one call)", "ours ring (steps)", "ours hybrid u=2",
        "ours hybrid u=2 (one call)", "ours hybrid u=2 (steps)", "ours ring (concurrent)",
        "ours hybrid u=2 (concurrent)", "ours ring (concurrent, split)",
        "ours hybrid u=2 (concurrent, split)", "contiguous", "doc-zigzag (padded)")] * 2
    _check_cells(rows)


def test_capped_rows_are_magiattentions_setting(capsys):
    """The capped mix (MagiAttention's benchmark setting, `--mixes capped`): every document at
    most a quarter of the row, the row whole, and the tool runs on it."""
    from bench_cp import capped_row

    rng = np.random.default_rng(0)
    for n in (64, 1000, 65536):
        for _ in range(50):
            lengths = np.diff(capped_row(n, rng))
            assert lengths.sum() == n and lengths.min() >= 1 and lengths.max() <= n // 4
    bench_cp_gpu.main(["--samples", "1", "--repeats", "1", "--heads", "4", "--kv-heads", "1",
                       "--head-dim", "16", "--configs", "512:4", "--mixes", "capped",
                       "--only", "^ours ring$"])
    rows = _rows(capsys)
    assert [r[0] for r in rows][:2] == ["| ideal", "| ours ring"], rows


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernel on a CPU needs Triton's interpreter")
def test_small_cpu_run_of_the_fused_rows(capsys, monkeypatch):
    from megatron_eod.attention import triton_backward, triton_forward
    monkeypatch.setattr(triton_forward, "LAUNCH_OVERRIDE", None)  # restored after
    monkeypatch.setattr(triton_backward, "BACKWARD_OVERRIDE", None)
    monkeypatch.setattr(triton_backward, "ATOMIC_DQ", True)  # the flag's shape sets it
    # (one row of each kind: ring's and hybrid's compute alike, and the concurrent rows as
    # the plain ones on a CPU; the others left out, for time)
    bench_cp_gpu.main(["--samples", "1", "--repeats", "1", "--heads", "2", "--kv-heads", "1",
                       "--head-dim", "16", "--configs", "128:2", "--mixes", "web",
                       "--only", r"^ours ring \(fused\)$|^ours hybrid u=2 \(fused fwd\+bwd\)$"
                                 r"|^whole row, fused kernel$",
                       "--tile-rows", "32",
                       "--fused-config", "16:4:2", "--fused-backward-config", "16:16:4:2",
                       "--key-tile-keys", "16"])
    assert triton_forward.LAUNCH_OVERRIDE == (16, 4, 2)
    assert triton_backward.BACKWARD_OVERRIDE == (16, 16, 4, 2)
    assert not triton_backward.ATOMIC_DQ
    rows = _rows(capsys)
    assert [r[0] for r in rows] == ["| " + name for name in (
        "ideal", "ours ring (fused)", "ours hybrid u=2 (fused fwd+bwd)",
        "whole row, fused kernel")]
    # Its tiles are its own (short documents share them): it may need fewer than the ideal's.
    _check_cells(rows, least_tiles=0.5)


def _check_cells(rows, least_tiles=0.95):
    for cells in rows:
        fwd, bwd, both = (float(x) for x in cells[1].split(" / "))
        # backward = both - forward, two timings: on a busy CPU it can come out <= 0
        assert fwd > 0 and both > 0
        device_ms, over = cells[3].split(" (")
        assert float(device_ms) > 0 and float(over.rstrip(")")) > 0
        tile_fwd, tile_bwd = (float(x) for x in cells[4].split(" / "))
        # no layout of the varlen kernel beats the whole row's tiles
        assert tile_fwd >= least_tiles and tile_bwd >= least_tiles
    assert all(r[2] == "1.00 / 1.00 / 1.00" and r[3].endswith("(1.00)")
               and r[4] == "1.00 / 1.00" for r in rows if r[0] == "| ideal")


@pytest.mark.parametrize("algo,u", [("ring", None), ("hybrid", 2)])
def test_one_call_rows_cover_exactly_each_groups_pieces(algo, u):
    """The "one call" layout: a group's runs of positions, each inside one document, together
    exactly the positions the group holds, with its document's start as the keys' start."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        lengths = rng.integers(1, 300, size=rng.integers(1, 30))
        n = -(-int(lengths.sum()) // 16) * 16
        lengths[-1] += n - int(lengths.sum())
        cu = np.r_[0, np.cumsum(lengths)]
        plan = plan_context_parallel(torch.from_numpy(cu), 4, algo, u)
        for g in range(plan.ring_size):
            segments = bench_cp_gpu.plan_segments(plan, g, cu)
            held = np.sort(plan.group_tokens(g).numpy())
            covered = np.sort(np.concatenate([np.arange(a, b) for a, b, _ in segments]))
            assert np.array_equal(covered, held)
            for a, b, start in segments:
                doc = np.searchsorted(cu, a, side="right") - 1
                assert start == cu[doc] and b <= cu[doc + 1]


@pytest.mark.gpu
def test_device_clock_hides_launches():
    """Tiny kernels are launch-bound on the wall clock; the device-only clock, whose
    launches are queued behind a sleep kernel, must see them run back to back (much less
    time), and must still see device-bound work whole (a large matmul: same on both clocks)."""
    import torch
    device = torch.device("cuda")
    x = torch.zeros(16, device=device)
    big = torch.randn(4096, 4096, device=device)

    def tiny():  # a slow host: 100 tiny kernels, 0.2 ms of host work before each
        for _ in range(100):
            time.sleep(2e-4)
            x.add_(1)

    wall = bench_cp_gpu.timed(tiny, 3, device)
    hidden = bench_cp_gpu.device_timed(tiny, 3, device)
    print(f"[figure] 100 tiny kernels behind a slow host: wall {wall * 1e3:.3f} ms, "
          f"device-only {hidden * 1e3:.3f} ms")
    assert wall >= 0.02 and hidden < 0.1 * wall
    matmul = (bench_cp_gpu.timed(lambda: big @ big, 3, device),
              bench_cp_gpu.device_timed(lambda: big @ big, 3, device))
    print(f"[figure] 4096^2 matmul: wall {matmul[0] * 1e3:.3f} ms, device-only "
          f"{matmul[1] * 1e3:.3f} ms")
    assert 0.8 * matmul[0] < matmul[1] <= 1.05 * matmul[0]


class _FakeCuda:
    """The torch.cuda calls device_timed makes, on a CPU: the host needs `enqueue` times the
    first sleep to enqueue fn; a shorter sleep shows as start.query() True (it ended first)."""

    def __init__(self, enqueue):
        self.enqueue, self.sleeps = enqueue, []
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self):
                pass

            def query(self):
                return fake.sleeps[-1] < fake.enqueue * fake.sleeps[0]

            def elapsed_time(self, other):
                return 2.0  # ms

        self.Event = Event

    def install(self, monkeypatch):
        import torch
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(torch.cuda, "_sleep", self.sleeps.append)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(bench_cp_gpu, "_SLEEP_RATE", [1e9])


def test_device_clock_redoes_a_late_run_with_twice_the_sleep(monkeypatch):
    import torch
    fake = _FakeCuda(enqueue=3.5)  # the first two sleeps are too short
    fake.install(monkeypatch)
    seconds = bench_cp_gpu.device_timed(lambda: None, 3, torch.device("cuda"))
    assert seconds == 2e-3
    first = fake.sleeps[0]
    assert fake.sleeps == [first, 2 * first, 4 * first] + [4 * first] * 2, fake.sleeps


def test_device_clock_gives_up_on_work_it_cannot_hide(monkeypatch):
    """A host sync inside fn makes every run late: NaN and a warning after MAX_LATE
    doublings, not an endless doubling of the sleep."""
    import torch
    fake = _FakeCuda(enqueue=float("inf"))
    fake.install(monkeypatch)
    with pytest.warns(UserWarning, match="could not be hidden"):
        seconds = bench_cp_gpu.device_timed(lambda: None, 5, torch.device("cuda"))
    assert seconds != seconds  # NaN
    assert len(fake.sleeps) == bench_cp_gpu.MAX_LATE + 1


@pytest.mark.parametrize("heads,kv_heads,degree,rank_kv", [
    (32, 8, 2, 4), (8, 2, 4, 1), (8, 1, 2, 1), (12, 4, 3, 4), (4, 4, 1, 4)])
def test_hybrid_rows_time_one_ranks_heads(heads, kv_heads, degree, rank_kv):
    """A hybrid layout is timed as ONE rank of its Ulysses group computes after the
    all-to-all: H/u query heads and the key/value heads ulysses.py gives that rank (not the
    group's all-head work divided by u, which hides the kernel's tail)."""
    q, dout = torch.randn(10, heads, 4), torch.randn(10, heads, 4)
    k, v = torch.randn(10, kv_heads, 4), torch.randn(10, kv_heads, 4)
    rq, rk, rv, rd = bench_cp_gpu.ulysses_rank_inputs(q, k, v, dout, degree)
    assert rq.shape == rd.shape == (10, heads // degree, 4)
    assert rk.shape == rv.shape == (10, rank_kv, 4)
    assert all(t.is_contiguous() for t in (rq, rk, rv, rd))
    assert rq.shape[1] % rk.shape[1] == 0  # a valid GQA call


def _printed_layouts(out):
    return [line.split(" | ")[0][2:] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| layout")]


@pytest.mark.parametrize("only,expected", [
    ("one call|contiguous", ["ideal", "ours ring (one call)", "ours hybrid u=2 (one call)",
                             "contiguous"]),
    ("^ours", ["ideal", "ours ring", "ours ring (one call)", "ours hybrid u=2",
               "ours hybrid u=2 (one call)", "ours ring (concurrent)",
               "ours hybrid u=2 (concurrent)", "ours ring (concurrent, split)",
               "ours hybrid u=2 (concurrent, split)", "ours ring (fused)",
               "ours hybrid u=2 (fused)", "ours ring (fused, concurrent)",
               "ours hybrid u=2 (fused, concurrent)", "ours ring (fused, concurrent backward)",
               "ours hybrid u=2 (fused, concurrent backward)", "ours ring (fused fwd+bwd)",
               "ours hybrid u=2 (fused fwd+bwd)", "ours ring (fused fwd+bwd, concurrent)",
               "ours hybrid u=2 (fused fwd+bwd, concurrent)"]),
])
def test_only_times_the_layouts_it_names_and_the_ideal(monkeypatch, capsys, only, expected):
    """--only (a short GPU lease's way to the open rows): the layouts whose name the pattern
    finds, and the ideal every ratio is over; nothing else is timed (a layout left out costs
    no kernel time: `busiest` is never called for it)."""
    timed_calls = []

    def fake_busiest(fns, repeats, device, share=1):
        timed_calls.append(len(fns))
        return 1e-3, 3e-3, 3e-3

    monkeypatch.setattr(bench_cp_gpu, "busiest", fake_busiest)
    bench_cp_gpu.main(["--samples", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                       "--configs", "2048:4", "--mixes", "web", "--only", only])
    assert _printed_layouts(capsys.readouterr().out) == expected
    assert len(timed_calls) == len(expected)


def test_a_failing_row_is_nan_and_the_others_still_come_back(monkeypatch, capsys):
    """A kernel that fails on the lent GPU (one row, in one of two samples) costs its row's
    cells, with its traceback, not the run: every row is printed, the failing one NaN."""
    calls = []

    def fake_busiest(fns, repeats, device, share=1):
        calls.append(len(fns))
        if len(calls) == 3:  # the first sample's "ours ring (one call)"
            raise RuntimeError("out of resources: shared memory")
        return 1e-3, 3e-3, 3e-3

    monkeypatch.setattr(bench_cp_gpu, "busiest", fake_busiest)
    bench_cp_gpu.main(["--samples", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                       "--configs", "2048:4", "--mixes", "web", "--only", "^ours ring$|ring.*one"])
    out, err = capsys.readouterr()
    rows = {line.split(" | ")[0][2:]: line for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| layout")}
    assert list(rows) == ["ideal", "ours ring", "ours ring (one call)"], out
    assert "nan" in rows["ours ring (one call)"] and "nan" not in rows["ours ring"]
    assert "[bench] ours ring (one call) failed:" in err and "out of resources" in err


@pytest.mark.parametrize("argv,message", [
    (["--only", "zzz"], "--only: 'zzz' selects no layout; layouts: ideal, ours ring"),
    (["--only", "ideal"], "--only: 'ideal' selects no layout"),
    (["--only", "(ring"], "--only: '(ring' is not a regular expression"),
    (["--only", "steps"], "--only: 'steps' selects no layout"),  # steps rows need --steps
    (["--mixes", "stdlib,books"],
     "--mixes: 'stdlib,books'; each must be one of stdlib, web, capped"),
    # (Tracebacks before: a tools sweep.)
    (["--configs", "abc"], "--configs: each entry is TOKENS:CP (e.g. 32768:4), got 'abc'"),
    (["--configs", "1024"], "got '1024'"),
    (["--configs", "1024:2:3"], "got '1024:2:3'"),
    (["--configs", "1024:0"], "--configs: tokens and cp must be positive, got '1024:0'"),
    (["--configs", "0:4"], "must be positive, got '0:4'"),
    (["--kv-heads", "0"], "argument --kv-heads: must be >= 1, got 0"),  # ZeroDivisionError
    (["--samples", "0"], "argument --samples: must be >= 1, got 0"),  # IndexError
    (["--repeats", "0"], "argument --repeats: must be >= 1"),  # the warm-up reported as timed
    (["--head-dim", "x"], "argument --head-dim: expected a positive integer, got 'x'"),
    (["--tile-rows", "48"], "--tile-rows must be a power of two >= 16, got 48"),
    (["--fused-config", "64:8"], "--fused-config: BLOCK_N:WARPS:STAGES (e.g. 64:8:3)"),
    (["--fused-config", "48:8:3"], "--fused-config 48:8:3: BLOCK_N a power of two >= 16"),
    (["--fused-config", "64:3:3"], "WARPS 1, 2, 4, 8 or 16"),
    (["--fused-backward-config", "32:32:8"], "--fused-backward-config: DQ_BLOCK_N:DKDV_BLOCK_M:"
                                             "WARPS:STAGES[:DKDV_WARPS] (e.g. 32:32:8:2), got "
                                             "'32:32:8'"),
    (["--fused-backward-config", "32:32:8:2:4:4"], "got '32:32:8:2:4:4'"),
    (["--fused-backward-config", "32:32:8:2:3"], "WARPS 1, 2, 4, 8 or 16"),
    (["--fused-backward-config", "32:24:8:2"], "the blocks powers of two >= 16"),
    (["--fused-backward-config", "atomic:32:8:2:3"], "--fused-backward-config atomic:32:8:2:3: "
                                                     "the blocks powers of two >= 16, WARPS"),
    (["--key-tile-keys", "48"], "--key-tile-keys must be a power of two >= 16, got 48"),
])
def test_bad_selections_name_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench_cp_gpu.main(argv)
    assert message in capsys.readouterr().err
