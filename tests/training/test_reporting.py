"""The lean trainer's log lines average the lm loss and the time per iteration over the
iterations since the last line, as Megatron-LM's do (they showed the printed iteration's own,
so --log-interval N > 1 gave other numbers than Megatron-LM's trainer for one run); the
--metrics-file keeps each iteration's own."""

import argparse
import json

import pytest

from megatron_eod.training.reporting import Reporter


def test_lines_average_since_the_last_line_and_the_metrics_keep_each_iteration(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    args = argparse.Namespace(metrics_file=str(metrics), tensorboard_dir=None, log_interval=2,
                              train_iters=5, global_batch_size=4, seq_length=8,
                              num_attention_heads=2, kv_channels=4, num_layers=1, world_size=1)
    reporter = Reporter(args, True)
    for iteration, (loss, seconds) in enumerate([(1.0, 0.1), (2.0, 0.3), (4.0, 0.2),
                                                 (float("nan"), 0.4), (8.0, 0.5)], start=1):
        reporter.iteration(iteration, seconds, 1e-3, loss, 1.0, 0, 0, 4 * iteration, 10)
    reporter.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "iteration" in line]
    assert len(lines) == 3  # iterations 2, 4 and the last
    assert "(ms): 200.0 |" in lines[0] and "lm loss: 1.500000E+00 |" in lines[0]
    assert "(ms): 300.0 |" in lines[1] and "lm loss: 4.000000E+00 |" in lines[1]  # NaN left out
    assert "(ms): 500.0 |" in lines[2] and "lm loss: 8.000000E+00 |" in lines[2]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["lm_loss"] for r in records][:3] == [1.0, 2.0, 4.0]
    assert [round(r["iteration_ms"]) for r in records] == [100, 300, 200, 400, 500]


def test_throughput_lines_divide_the_work_since_the_last_line_by_its_time(tmp_path, capsys):
    """--log-throughput: with EoD the attention work changes every iteration; the line's
    figure is the interval's work over the interval's time (as Megatron-LM accumulates its
    FLOPs between lines), the metrics keep each iteration's own."""
    from megatron_eod.training.model_stats import model_flops

    metrics = tmp_path / "m.jsonl"
    args = argparse.Namespace(metrics_file=str(metrics), tensorboard_dir=None, log_interval=2,
                              train_iters=2, global_batch_size=4, seq_length=8,
                              num_attention_heads=2, num_query_groups=2, kv_channels=4,
                              hidden_size=8, ffn_hidden_size=32, swiglu=False, num_layers=1,
                              world_size=1, log_throughput=True)
    reporter = Reporter(args, True, vocab_size=64)
    steps = [(1e12, 2.0), (9e12, 1.0)]  # (attention pairs, seconds)
    for iteration, (pairs, seconds) in enumerate(steps, start=1):
        reporter.iteration(iteration, seconds, 1e-3, 1.0, 1.0, 0, 0, 4 * iteration, pairs)
    reporter.close()
    work = [model_flops(args, 64, 32, pairs) for pairs, _ in steps]
    line = [line for line in capsys.readouterr().out.splitlines() if "iteration" in line][0]
    assert f"throughput per GPU (TFLOP/s/GPU): {sum(work) / 3.0 / 1e12:.1f} |" in line
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["model_tflops_per_gpu"] for r in records] == pytest.approx(
        [w / s / 1e12 for w, (_, s) in zip(work, steps)])


def test_evaluation_lines_say_which_evaluation_as_megatron_lm_does(tmp_path, capsys):
    """The in-loop evaluation at the last iteration and the final one after training printed
    the same "validation loss at iteration 20" with two values (a helper's docs walk)."""
    metrics = tmp_path / "m.jsonl"
    args = argparse.Namespace(metrics_file=str(metrics), tensorboard_dir=None, log_interval=1,
                              train_iters=20, global_batch_size=4, seq_length=8,
                              num_attention_heads=2, kv_channels=4, num_layers=1, world_size=1)
    reporter = Reporter(args, True)
    reporter.validation(20, 4.0, "validation", in_loop=True)
    reporter.validation(20, 4.1, "validation")
    reporter.validation(20, 4.2, "test")
    reporter.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "loss at" in line]
    assert [line.split("|")[0].strip() for line in lines] == [
        "validation loss at iteration 20", "validation loss at iteration 20 on validation set",
        "validation loss at iteration 20 on test set"]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["kind"], r["lm_loss"]) for r in records] == [("valid", 4.0), ("valid", 4.1),
                                                            ("test", 4.2)]
