"""A run whose loss or grad norm turns NaN/Inf stops (lean trainer), as Megatron-LM's
--check-for-nan-in-loss-and-grad does; --no-check-for-nan-in-loss-and-grad keeps going and
counts the iterations."""

import contextlib
import io

from megatron_eod.training.pretrain import pretrain
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks

# --lr 1e3 in float32: the grad norm goes non-finite within a few iterations.
DIVERGE = ["--lr", "1e3", "--min-lr", "0", "--lr-warmup-iters", "0", "--clip-grad", "0",
           "--context-parallel-size", "2"]


def _train(rank, world, argv):
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            losses = pretrain(argv)
    except SystemExit as stop:
        return stop.code, err.getvalue(), None
    return 0, err.getvalue() + out.getvalue(), losses


def test_non_finite_loss_or_grad_norm_stops_every_rank(tiny_data):
    results = run_ranks(_train, 2, tiny_flags(tiny_data, *DIVERGE))
    assert [code for code, _, _ in results] == [1, 1]
    for _, message, _ in results:  # every rank: torchrun may end rank 0 before it prints
        assert "pretrain_gpt.py: error: iteration" in message
        assert "is NaN or Inf" in message and "--no-check-for-nan-in-loss-and-grad" in message


def test_the_check_can_be_turned_off(tiny_data):
    argv = tiny_flags(tiny_data, *DIVERGE, "--no-check-for-nan-in-loss-and-grad",
                      "--log-interval", "1")
    results = run_ranks(_train, 2, argv)
    code, text, losses = results[-1]
    assert code == 0 and len(losses) == 10
    last = [line for line in text.splitlines() if "iteration       10/" in line][0]
    assert "number of nan iterations:   0" not in last


def _train_with_nan_evaluation(rank, world, argv, only_after_training=False):
    """Evaluation's losses turn NaN (a bad validation shard, an fp16 overflow in eval): every
    evaluation, or only those after the last iteration."""
    from megatron_eod.training import pretrain as module
    schedule = module._Trainer._schedule

    def nan_when_evaluating(self, data_iterator, forward_only, num_micro_batches):
        outputs = schedule(self, data_iterator, forward_only, num_micro_batches)
        if forward_only and (not only_after_training
                             or self.iteration == self.args.train_iters):
            for out in outputs:
                out["lm loss"] = out["lm loss"] * float("nan")
        return outputs

    module._Trainer._schedule = nan_when_evaluating
    return _train(rank, world, argv)


def test_a_non_finite_evaluation_loss_stops_every_rank(tiny_data):
    """As Megatron-LM's loss checks, which run in evaluation too (before, the lean trainer
    printed `validation loss nan` and trained on)."""
    results = run_ranks(_train_with_nan_evaluation, 2,
                        tiny_flags(tiny_data, "--context-parallel-size", "2"))
    assert [code for code, _, _ in results] == [1, 1]
    assert "validation at iteration 5: lm loss is NaN or Inf" in results[0][1]
    argv = tiny_flags(tiny_data, "--context-parallel-size", "2",
                      "--no-check-for-nan-in-loss-and-grad")
    assert [code for code, _, _ in run_ranks(_train_with_nan_evaluation, 2, argv)] == [0, 0]


def _train_with_nan_final_evaluation(rank, world, argv):
    return _train_with_nan_evaluation(rank, world, argv, only_after_training=True)


def test_a_non_finite_final_evaluation_keeps_the_final_checkpoint(tiny_data, tmp_path):
    """The last iterations are saved before the evaluations that follow training (as
    Megatron-LM's pretrain() orders them) and before the last iteration's own evaluation in
    the loop (Megatron-LM saves after that one): a NaN in either stops the run, but the
    iterations since the last periodic save are kept (they were lost before; a review found
    the in-loop one losing them again when it was added)."""
    save = tmp_path / "ckpt"
    argv = tiny_flags(tiny_data, "--context-parallel-size", "2", "--save", str(save),
                      "--save-interval", "100")
    results = run_ranks(_train_with_nan_final_evaluation, 2, argv, daemon=False)  # saving forks
    assert [code for code, _, _ in results] == [1, 1]
    assert "validation at iteration 10: lm loss is NaN or Inf" in results[0][1]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
