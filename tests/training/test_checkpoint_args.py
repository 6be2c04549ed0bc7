"""--use-checkpoint-args in the lean trainer, as Megatron-LM's: a launch script without the
model's flags resumes the checkpoint's model (either format) and trains as the one that
gives them all; the architecture switches are the checkpoint's even where the script says
otherwise (the start-up line names them); the tokenizer and, on request, the TP/PP sizes come
along; every way it can fail is one line naming the flag. (A Megatron-LM checkpoint read this
way: test_checkpoint_interop.py.)"""

import os

import pytest

from megatron_eod.training.args import parse_args
from megatron_eod.training.checkpoint_args import checkpoint_args_notice
from megatron_eod.training.cp_flags import FlagError
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train

pytestmark = pytest.mark.timeout(300)

# A model the tiny flags' defaults would not build: every shape flag differs from them.
MODEL = ("--swiglu", "--qk-layernorm", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--ffn-hidden-size",
         "96", "--rotary-base", "500", "--disable-bias-linear")
# What a script using --use-checkpoint-args leaves out (with their values).
SHAPE_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--group-query-attention",
               "--num-query-groups", "--position-embedding-type")


def _losses(results):
    assert [code for code, *_ in results] == [0] * len(results), results
    return results[0]


@pytest.fixture(scope="module", params=["torch_dist", "torch"])
def saved(request, tiny_data, tmp_path_factory):
    """A checkpoint at iteration 4 of the MODEL run, and the losses of its resumption."""
    root = tmp_path_factory.mktemp(f"ckpt_{request.param}")
    save = str(root / "ckpt")
    flags = (*MODEL, "--ckpt-format", request.param, "--context-parallel-size", "2")
    _losses(run_ranks(_train, 2, tiny_flags(tiny_data, *flags, "--save", save,
                                            "--exit-interval", "4"), daemon=False))
    full = _losses(run_ranks(_train, 2, tiny_flags(tiny_data, *flags, "--load", save),
                             daemon=False))
    return save, full


def test_a_script_without_the_model_flags_resumes_the_checkpoints_model(tiny_data, saved):
    save, (_, _, full) = saved
    argv = tiny_flags(tiny_data, "--use-checkpoint-args", "--load", save,
                      "--normalization", "LayerNorm", "--context-parallel-size", "2",
                      drop=SHAPE_FLAGS)
    code, text, losses = run_ranks(_train, 2, argv, daemon=False)[0]
    assert code == 0, text
    assert losses == full  # the same two steps, bitwise
    line = next(line for line in text.splitlines() if "--use-checkpoint-args: from" in line)
    for said in ("--num-layers=2", "--hidden-size=64", "--swiglu=True", "--qk-layernorm=True",
                 "--apply-layernorm-1p=True", "--norm-epsilon=1e-06", "--ffn-hidden-size=96",
                 "--rotary-base=500", "--disable-bias-linear=True", "--num-query-groups=2",
                 "--position-embedding-type=rope",
                 "--normalization=RMSNorm (not LayerNorm, as the flags said)"):
        assert said in line, (said, line)


def _parse(*flags, world_size=2):
    return parse_args(["--lr", "1e-3", "--train-iters", "10", "--mock-data", *flags],
                      world_size=world_size, cuda_available=False)


def test_sizes_the_script_gives_are_kept_and_switches_are_the_checkpoints(saved):
    save, _ = saved
    args = _parse("--use-checkpoint-args", "--load", save, "--seq-length", "256",
                  "--max-position-embeddings", "256", "--num-attention-heads", "8")
    assert (args.seq_length, args.num_attention_heads, args.swiglu) == (256, 8, True)
    assert args.hidden_size == 64 and args.num_layers == 2


def test_hidden_dropout_is_the_checkpoints_as_megatron_lm_takes_it(saved):
    """(A stock Megatron-LM checkpoint at 0.1 under a script saying 0: Megatron-LM's trainer
    took 0.1, the lean one kept 0 without a word, 4.8e-3 apart six iterations later.)"""
    save, _ = saved
    args = _parse("--use-checkpoint-args", "--load", save, "--hidden-dropout", "0.3")
    assert args.hidden_dropout == 0.0  # the saved run's
    assert "--hidden-dropout=0.0 (not 0.3, as the flags said)" in checkpoint_args_notice(args)


def test_tokenizer_and_parallel_sizes(saved):
    save, _ = saved
    base = ("--use-checkpoint-args", "--load", save, "--tensor-model-parallel-size", "2")
    args = _parse(*base, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300")
    assert args.tokenizer_type == "ByteTokenizer" and args.tensor_model_parallel_size == 2
    kept = _parse(*base, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
                  "--no-use-tokenizer-model-from-checkpoint-args")
    assert kept.tokenizer_type == "NullTokenizer"
    mp = _parse(*base, "--use-mp-args-from-checkpoint-args")
    assert mp.tensor_model_parallel_size == 1  # saved at TP=1
    assert "--tensor-model-parallel-size=1 (not 2, as the flags said)" in checkpoint_args_notice(mp)


def test_damaged_saved_args_are_one_line(saved, tmp_path):
    save, _ = saved
    copy = tmp_path / "ckpt"
    os.makedirs(copy / "iter_0000004")
    (copy / "latest_checkpointed_iteration.txt").write_text("4")
    folder = copy / "iter_0000004"
    if os.path.isfile(os.path.join(save, "iter_0000004", "metadata.json")):
        (folder / "metadata.json").write_text("{}")
        (folder / "common.pt").write_bytes(b"not a torch file")
    else:
        os.makedirs(folder / "mp_rank_00")
        (folder / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"not a torch file")
    with pytest.raises(FlagError, match=r"--use-checkpoint-args: cannot read the args saved in "):
        _parse("--use-checkpoint-args", "--load", str(copy))


@pytest.mark.parametrize("flags,match", [
    (("--use-checkpoint-args", "--num-layers", "2", "--hidden-size", "64",
      "--num-attention-heads", "4", "--seq-length", "128"),
     r"--use-checkpoint-args needs --load DIR or --pretrained-checkpoint DIR"),
    (("--use-checkpoint-args", "--load", "EMPTY", "--seq-length", "128"),
     r"--num-layers is required: --use-checkpoint-args found no checkpoint under --load .*empty "
     r"to take it from"),
])
def test_refusals(tmp_path, flags, match):
    flags = [str(tmp_path / "empty") if f == "EMPTY" else f for f in flags]
    with pytest.raises(FlagError, match=match):
        _parse(*flags)


def test_no_checkpoint_yet_uses_the_flags_given_and_says_so(tmp_path):
    args = _parse("--use-checkpoint-args", "--load", str(tmp_path), "--num-layers", "2",
                  "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128")
    assert args.num_layers == 2
    assert "no checkpoint yet; the flags given are used" in checkpoint_args_notice(args)
    assert checkpoint_args_notice(_parse("--num-layers", "2", "--hidden-size", "64",
                                         "--num-attention-heads", "4",
                                         "--seq-length", "128")) is None


def _edited_copy(save, tmp_path, **changes):
    """A copy of the checkpoint `save` whose saved args carry `changes` (reading and writing
    the file that holds them: common.pt of torch_dist, the rank files of torch)."""
    import shutil

    import torch

    copy = tmp_path / "edited"
    shutil.copytree(save, copy)
    files = list(copy.glob("iter_0000004/common.pt")) or list(
        copy.glob("iter_0000004/mp_rank_*/model_optim_rng.pt"))
    if not files:
        pytest.skip("this megatron-core keeps the saved args inside the .distcp files")
    for path in files:
        state = torch.load(path, weights_only=False)
        for name, value in changes.items():
            setattr(state["args"], name, value)
        torch.save(state, path)
    return str(copy)


def test_saved_multi_head_attention_with_megatron_lms_leftover_group_count(saved, tmp_path):
    """Megatron-LM builds multi-head attention from group_query_attention False whatever
    num_query_groups says (1 in args that never trained); that 1 was taken and refused as
    "--num-query-groups 1 without --group-query-attention", flags the user never gave."""
    copy = _edited_copy(saved[0], tmp_path, group_query_attention=False, num_query_groups=1)
    for script in ((), ("--group-query-attention", "--num-query-groups", "2")):
        args = _parse("--use-checkpoint-args", "--load", copy, *script)
        assert not args.group_query_attention
        assert args.num_query_groups == args.num_attention_heads


def test_a_saved_tokenizer_path_missing_here(saved, tmp_path):
    copy = _edited_copy(saved[0], tmp_path, tokenizer_type="HuggingFaceTokenizer",
                        tokenizer_model="/nonexistent/llama-tok")
    with pytest.raises(FlagError, match=r"was saved with --tokenizer-model /nonexistent/llama-tok"
                                        r", which is not on this machine; pass "
                                        r"--tokenizer-model PATH"):
        _parse("--use-checkpoint-args", "--load", copy)
    kept = _parse("--use-checkpoint-args", "--load", copy, "--tokenizer-model", "/here/tok")
    assert (kept.tokenizer_type, kept.tokenizer_model) == ("HuggingFaceTokenizer", "/here/tok")


def test_a_damaged_tracker_is_one_line(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(FlagError, match=r"--use-checkpoint-args: .* holds 'garbage', not an "
                                        r"iteration"):
        _parse("--use-checkpoint-args", "--load", str(tmp_path))
