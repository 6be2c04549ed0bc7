"""The lean trainer's checkpoints are megatron-core's (torch_dist by default, Megatron-LM's
legacy torch on request) and reshard on --load:

- saved at TP=2 x CP=2 with the distributed optimizer ("fully_reshardable"), loaded at
  TP=1 x CP=4: iterations 5..10 continue the CP=1 losses (1e-5);
- the distributed optimizer's default "dp_reshardable" state refuses a TP change, naming the
  flag that saves it reshardable;
- --ckpt-format torch writes Megatron-LM's mp_rank_XX files and resumes bit-identically, with
  the distributed optimizer's distrib_optim.pt beside them;
- --finetune loads the weights only (iteration 0, fresh optimizer and data position);
- a checkpoint of another model is refused by flag name, not by a shape error: exit 2 and
  one line on every rank, no traceback.
"""

import os

import pytest
import torch

from tests.functional.test_cpu_training import assert_same, cp1, train  # noqa: F401
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train

pytestmark = pytest.mark.timeout(300)

DISTOPT = ("--use-distributed-optimizer",)


def refused(world, data, *extra):
    """The error line of a run every rank of which stops at --load (exit 2, no traceback)."""
    results = run_ranks(_train, world, tiny_flags(data, *extra), timeout=200, daemon=False)
    assert [code for code, _, _ in results] == [2] * world, results
    lines = []
    for _, text, _ in results:  # after any warnings of megatron-core's (0.19 has some)
        said = [line for line in text.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
        assert len(said) == 1 and said[0].startswith("pretrain_gpt.py: error: --load ") and \
            "Traceback" not in text, text
        lines.append(said[0])
    return lines[0]


def test_tp2_cp2_checkpoint_continues_at_tp1_cp4(cp1, short_docs_data, tmp_path):  # noqa: F811
    save = str(tmp_path / "ckpt")
    # Vocabulary padding is a multiple of divisible-by x TP: 64 x 2 keeps TP=1's 384 rows.
    first = train(4, short_docs_data, "--tensor-model-parallel-size", "2",
                  "--context-parallel-size", "2", "--make-vocab-size-divisible-by", "64", *DISTOPT,
                  "--dist-ckpt-optim-fully-reshardable", "--save", save, "--exit-interval", "4")
    assert os.path.isfile(os.path.join(save, "iter_0000004", "metadata.json"))
    rest = train(4, short_docs_data, "--context-parallel-size", "4", *DISTOPT, "--load", save)
    assert len(first) == 4 and len(rest) == 6
    assert_same(first + rest, cp1)


def test_dp_reshardable_optimizer_state_refuses_a_tp_change(short_docs_data, tmp_path):
    save = str(tmp_path / "ckpt")
    train(2, short_docs_data, "--tensor-model-parallel-size", "2", *DISTOPT, "--save", save,
          "--exit-interval", "2")
    assert "--dist-ckpt-optim-fully-reshardable" in refused(
        2, short_docs_data, "--context-parallel-size", "2", *DISTOPT, "--load", save)


def test_legacy_torch_format_resumes_bit_identically(short_docs_data, tmp_path):
    save = str(tmp_path / "ckpt")
    first = train(2, short_docs_data, "--context-parallel-size", "2", "--ckpt-format", "torch",
                  "--save", save, "--exit-interval", "4")
    assert os.listdir(os.path.join(save, "iter_0000004")) == ["mp_rank_00"]
    rest = train(2, short_docs_data, "--context-parallel-size", "2", "--load", save)
    full = train(2, short_docs_data, "--context-parallel-size", "2")
    assert first + rest == full


def test_legacy_torch_format_with_the_distributed_optimizer(cp1, short_docs_data,  # noqa: F811
                                                            tmp_path):
    """Megatron-LM's layout: the optimizer's shards gathered into distrib_optim.pt beside
    mp_rank_00's file (the lean trainer refused --ckpt-format torch with the distributed
    optimizer, so it could not resume such a checkpoint of Megatron-LM's at all); it loads
    at another DP x CP split, and a run without the distributed optimizer is told so."""
    save = str(tmp_path / "ckpt")
    first = train(2, short_docs_data, "--context-parallel-size", "2", *DISTOPT, "--ckpt-format",
                  "torch", "--save", save, "--exit-interval", "4")
    assert sorted(os.listdir(os.path.join(save, "iter_0000004", "mp_rank_00"))) == [
        "distrib_optim.pt", "model_optim_rng.pt"]
    rest = train(2, short_docs_data, *DISTOPT, "--load", save, "--save", save,  # DP=2 x CP=1
                 "--ckpt-format", "torch")
    assert len(first) == 4 and len(rest) == 6
    assert_same(first + rest, cp1)
    # What Megatron-LM reads back: the FLOPs so far carried over the resume (they were
    # saved as 0), the loss per token and the padded vocabulary.
    flops = []
    for iteration in (4, 10):
        state = torch.load(os.path.join(save, f"iter_{iteration:07d}", "mp_rank_00",
                                        "model_optim_rng.pt"), weights_only=False)
        flops.append(state["num_floating_point_operations_so_far"])
        assert state["args"].calculate_per_token_loss and state["args"].padded_vocab_size == 384
    assert 0 < flops[0] < flops[1]
    assert "holds the distributed optimizer's state (distrib_optim.pt): add " \
        "--use-distributed-optimizer" in refused(2, short_docs_data, "--load", save)


def test_finetune_loads_weights_only(cp1, short_docs_data, tmp_path):  # noqa: F811
    save, tuned_save = str(tmp_path / "ckpt"), str(tmp_path / "tuned")
    train(1, short_docs_data, "--save", save, "--exit-interval", "4")
    tuned = train(1, short_docs_data, "--load", save, "--finetune", "--save", tuned_save)
    assert len(tuned) == 10  # from iteration 0
    # The FLOPs so far go on from the checkpoint's, as in Megatron-LM (they restarted at 0).
    from megatron.core.dist_checkpointing import load_common_state_dict

    flops = [load_common_state_dict(os.path.join(root, f"iter_{iteration:07d}"))[
        "num_floating_point_operations_so_far"] for root, iteration in ((save, 4),
                                                                         (tuned_save, 10))]
    assert 0 < flops[0] and flops[1] > 2 * flops[0]  # 4 iterations, then 10 more
    assert tuned[0] < cp1[0] - 0.1  # the first batch again, on trained weights
    again = train(1, short_docs_data, "--pretrained-checkpoint", save)  # --load absent: the same
    assert again == tuned


def test_another_model_is_refused_by_flag_name(short_docs_data, tmp_path):
    save = str(tmp_path / "ckpt")
    train(1, short_docs_data, "--save", save, "--exit-interval", "2")
    assert "--ffn-hidden-size 256 (this run: 128)" in refused(
        1, short_docs_data, "--load", save, "--ffn-hidden-size", "128")


def test_other_embedding_rows_are_refused_where_they_cannot_load(short_docs_data, tmp_path):
    """Learned positions of another --max-position-embeddings, another padded vocabulary in a
    torch-format checkpoint or in the distributed optimizer's dp_reshardable state: shape
    errors deep in torch or megatron-core before (torch_dist reshards the model's own rows)."""
    learned, save = ("--position-embedding-type", "learned_absolute"), str(tmp_path / "pos")
    train(1, short_docs_data, *learned, "--save", save, "--exit-interval", "2")
    assert "--max-position-embeddings 128 (this run: 256)" in refused(
        1, short_docs_data, *learned, "--max-position-embeddings", "256", "--load", save)
    smaller = ("--make-vocab-size-divisible-by", "64")  # the byte vocabulary's 258: 320, not 384
    for kind, flags in (("torch", ("--ckpt-format", "torch")),
                        ("optimizer", ("--use-distributed-optimizer",))):
        save = str(tmp_path / kind)
        train(1, short_docs_data, *flags, "--save", save, "--exit-interval", "2")
        line = refused(1, short_docs_data, *flags, *smaller, "--load", save)
        assert ("the padded vocabulary (--make-vocab-size-divisible-by, the tokenizer's size) "
                + ("384 (this run: 320)" if kind == "torch" else
                   "is 384 in the checkpoint, 320 here, and the distributed optimizer's state "
                   "saved 'dp_reshardable' keeps the saved shapes")) in line, line


def test_pp2_checkpoint_continues_at_pp1_with_dp2(short_docs_data, tmp_path):
    """Pipeline stages merge on --load (layer offsets are global in the sharded state), and the
    data position carries over to a new DP size."""
    save = str(tmp_path / "ckpt")
    first = train(2, short_docs_data, "--pipeline-model-parallel-size", "2", "--save", save,
                  "--exit-interval", "4")
    rest = train(2, short_docs_data, "--load", save)  # PP=1 x DP=2
    full = train(2, short_docs_data, "--pipeline-model-parallel-size", "2")
    assert_same(first + rest, full)


def test_another_run_into_the_same_save_dir_replaces_the_checkpoint(short_docs_data, tmp_path):
    """Only the checkpoint a run resumed from (--load == --save, no step since) is not written
    again; a fresh run reaching the same iteration in that directory replaces it."""
    save = str(tmp_path / "ckpt")
    train(1, short_docs_data, "--save", save, "--exit-interval", "2")
    metadata = os.path.join(save, "iter_0000002", "metadata.json")
    first = os.stat(metadata).st_mtime_ns
    train(1, short_docs_data, "--save", save, "--exit-interval", "2", "--seed", "7")
    assert os.stat(metadata).st_mtime_ns != first
    again = os.stat(metadata).st_mtime_ns
    train(1, short_docs_data, "--load", save, "--save", save, "--train-iters", "2",
          "--lr-decay-iters", "10", "--use-checkpoint-opt_param-scheduler",
          drop=("--train-iters",))
    assert os.stat(metadata).st_mtime_ns == again  # resumed at 2, nothing new to write


def test_legacy_torch_format_refuses_another_tp_size_by_flag(short_docs_data, tmp_path):
    save = str(tmp_path / "ckpt")
    train(2, short_docs_data, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by",
          "64", "--ckpt-format", "torch", "--save", save, "--exit-interval", "2")
    assert "saved at --tensor-model-parallel-size 2 loads only at that size (this run: 1)" in \
        refused(1, short_docs_data, "--load", save)


def test_gloo_groups_are_made_only_for_the_torch_formats_distributed_optimizer(tmp_path):
    """Megatron-LM makes gloo data-parallel groups always; the lean trainer only where the
    distributed optimizer's distrib_optim.pt is written or read, and says so where
    --disable-gloo-process-groups forbids them."""
    import argparse

    from megatron_eod.training.checkpoint_files import needs_gloo_dp_groups
    from megatron_eod.training.cp_flags import FlagError

    torch_ckpt = tmp_path / "ckpt"
    (torch_ckpt / "iter_0000004" / "mp_rank_00").mkdir(parents=True)
    (torch_ckpt / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").touch()
    (torch_ckpt / "latest_checkpointed_iteration.txt").write_text("4")

    def needs(**flags):
        args = dict(use_distributed_optimizer=True, ckpt_format="torch_dist", save=None,
                    load=None, no_save_optim=False, no_load_optim=False, finetune=False,
                    disable_gloo_process_groups=False)
        return needs_gloo_dp_groups(argparse.Namespace(**{**args, **flags}))

    assert not needs() and not needs(save="s") and needs(save="s", ckpt_format="torch")
    assert not needs(save="s", ckpt_format="torch", use_distributed_optimizer=False)
    assert not needs(save="s", ckpt_format="torch", no_save_optim=True)
    assert needs(load=str(torch_ckpt)) and not needs(load=str(torch_ckpt), finetune=True)
    assert not needs(load=str(torch_ckpt), no_load_optim=True)
    assert not needs(load=str(tmp_path / "empty"))
    with pytest.raises(FlagError, match="--disable-gloo-process-groups: the distributed "
                                        "optimizer's state .* pass --no-load-optim"):
        needs(load=str(torch_ckpt), disable_gloo_process_groups=True)
