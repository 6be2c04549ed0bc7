"""The lean trainer's log lines average the lm loss and the time per iteration over the
iterations since the last line, as Megatron-LM's do (they showed the printed iteration's own,
so --log-interval N > 1 gave other numbers than Megatron-LM's trainer for one run); the
--metrics-file keeps each iteration's own."""

import argparse
import json

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
