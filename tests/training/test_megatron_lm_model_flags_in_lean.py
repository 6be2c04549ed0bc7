"""Megatron-LM's model, fusion and data flags in the lean trainer: they build the model
Megatron-LM's trainer builds from them (its REAL config mapping, core_v0.16.1), change the
built modules, and reach megatron-core's dataset config; Megatron-LM's other spellings
(--encoder-seq-length, --use-rotary-position-embeddings, --recompute-activations) mean what
they mean there."""

import math

import pytest
import torch

from megatron_eod.training.args import FlagError, parse_args
from megatron_eod.training.model import ddp_config, transformer_config
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import needs_megatron_lm

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]
SHAPE = ["--norm-epsilon", "1e-6", "--apply-layernorm-1p", "--add-qkv-bias",
         "--disable-bias-linear", "--squared-relu", "--embedding-init-method-std", "0.01",
         "--normalization", "RMSNorm"]
FIELDS = ("layernorm_epsilon", "layernorm_zero_centered_gamma", "add_qkv_bias",
          "add_bias_linear", "activation_func", "embedding_init_method_std", "normalization",
          "gated_linear_unit", "bias_activation_fusion")


def lean(*flags, cuda=False):
    return parse_args([*MODEL, *flags], world_size=1, cuda_available=cuda)


@needs_megatron_lm
def test_model_flags_give_megatron_lms_config():
    from tests.training.test_megatron_lm_args import checked

    # Megatron-LM's bias-gelu fusion refuses squared ReLU: it needs --no-bias-gelu-fusion.
    theirs = checked(*SHAPE, "--no-bias-gelu-fusion", "--no-rope-fusion")
    from megatron.training.arguments import core_transformer_config_from_args

    theirs.params_dtype = torch.float32  # what its validate_args sets
    theirs = core_transformer_config_from_args(theirs)
    ours = transformer_config(lean(*SHAPE))
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(theirs, f) for f in FIELDS}
    assert ours.layernorm_epsilon == 1e-6 and ours.add_qkv_bias  # not both defaults


def _built(rank, world, argv):
    from megatron_eod.megatron.batch_context import EodContextRegistry
    from megatron_eod.training.model import build_model
    from megatron_eod.training.model_stats import matmul_weights
    from tests.megatron.tiny_model import cp_setup

    args = parse_args(argv, world_size=1, cuda_available=False)
    with cp_setup(1):
        torch.manual_seed(0)
        (model,), _ = build_model(args, EodContextRegistry(), 256)
    layer = model.module.decoder.layers[0]
    norm = layer.input_layernorm
    fc1 = layer.mlp.linear_fc1.weight
    weights = sum(p.numel() for name, p in model.module.named_parameters()
                  if p.dim() == 2 and "position_embeddings" not in name)
    return {"eps": norm.eps, "norm_weight": norm.weight.abs().max().item(),
            "qkv_bias": layer.self_attention.linear_qkv.bias is not None,
            "fc1_bias": layer.mlp.linear_fc1.bias is not None,
            "activation": layer.mlp.activation_func.__name__,
            "fc1_std": fc1.std().item(), "fc1_fans": sum(fc1.shape),
            "embedding_std": model.module.embedding.word_embeddings.weight.std().item(),
            "matmul_weights": (weights, matmul_weights(args, 256))}


def test_model_flags_change_the_built_model(tiny_data):
    (default,) = run_ranks(_built, 1, tiny_flags(tiny_data))
    (shaped,) = run_ranks(_built, 1, tiny_flags(tiny_data, *SHAPE))
    assert default["eps"] == 1e-5 and shaped["eps"] == 1e-6
    assert default["norm_weight"] == 1.0 and shaped["norm_weight"] == 0.0  # stored as gamma-1
    assert (shaped["qkv_bias"], shaped["fc1_bias"]) == (True, False)
    assert (default["activation"], shaped["activation"]) == ("gelu", "squared_relu")
    assert shaped["embedding_std"] == pytest.approx(0.01, rel=0.1)
    assert default["embedding_std"] == pytest.approx(0.02, rel=0.1)
    (xavier,) = run_ranks(_built, 1, tiny_flags(tiny_data, "--init-method-xavier-uniform"))
    # uniform(-a, a), a = sqrt(6 / (fan_in + fan_out)): std a / sqrt(3)
    assert xavier["fc1_std"] == pytest.approx(math.sqrt(2 / xavier["fc1_fans"]), rel=0.1)
    assert default["fc1_std"] == pytest.approx(0.02, rel=0.1)
    # --log-throughput's FLOPs count every matmul weight of the model, the output layer's too
    for built in (default, shaped):
        assert built["matmul_weights"][0] == built["matmul_weights"][1]


@pytest.mark.parametrize("flags,message", [
    (["--squared-relu", "--swiglu"], "--squared-relu and --swiglu are exclusive"),
    (["--no-position-embedding"], "--no-position-embedding is deprecated and, as in "
                                  "Megatron-LM, refused with --position-embedding-type "
                                  "learned_absolute: drop it"),
    (["--no-position-embedding", "--position-embedding-type", "none"],
     "drop it \\(--position-embedding-type none already adds no positions\\)"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
     "--cross-entropy-fusion-impl te needs the transformer_engine package"),
    (["--recompute-activations", "--recompute-granularity", "full"],
     "--recompute-activations means --recompute-granularity selective, not full"),
    (["--encoder-seq-length", "64"], "--seq-length 128 and --encoder-seq-length 64 differ"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 .* needs --bf16"),
    (["--norm-epsilon", "0"], "--norm-epsilon"),
    (["--exit-signal", "SIGNOPE"], "--exit-signal SIGNOPE: not a signal name"),
    (["--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0"),
])
def test_contradictions_are_named(flags, message):
    with pytest.raises(FlagError, match=message):
        lean(*flags)


def test_megatron_lms_other_spellings():
    args = parse_args([f if f != "--seq-length" else "--encoder-seq-length" for f in MODEL],
                      world_size=1, cuda_available=False)
    assert args.seq_length == 128
    with pytest.raises(FlagError, match="--seq-length is required"):
        parse_args(MODEL[:6] + MODEL[8:], world_size=1, cuda_available=False)
    assert lean("--use-rotary-position-embeddings").position_embedding_type == "rope"
    assert lean("--use-rotary-position-embeddings",
                "--no-position-embedding").position_embedding_type == "rope"
    assert lean("--recompute-activations").recompute_granularity == "selective"


def test_fusion_switches_turn_their_fusion_off(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # fusions are GPU-only
    on = transformer_config(lean())
    off = transformer_config(lean("--no-bias-gelu-fusion", "--no-bias-dropout-fusion"))
    assert (on.bias_activation_fusion, on.bias_dropout_fusion) == (True, True)
    assert (off.bias_activation_fusion, off.bias_dropout_fusion) == (False, False)
    swiglu = ("--swiglu", "--no-bias-swiglu-fusion")
    assert not transformer_config(lean(*swiglu)).bias_activation_fusion
    assert transformer_config(lean("--swiglu", "--no-bias-gelu-fusion")).bias_activation_fusion
    fused = transformer_config(lean("--cross-entropy-loss-fusion"))
    assert (fused.cross_entropy_loss_fusion, fused.cross_entropy_fusion_impl) == (True, "native")


def test_grad_reduce_in_bf16_reaches_ddp(monkeypatch):
    from megatron_eod.training import args_device as args_module

    monkeypatch.setattr(args_module, "check_gpu_attention", lambda *a: None)
    monkeypatch.setattr(args_module, "check_gloo_on_cuda", lambda *a: None)
    assert ddp_config(lean("--bf16", cuda=True), 1000).grad_reduce_in_fp32
    assert not ddp_config(lean("--bf16", "--grad-reduce-in-bf16", cuda=True),
                          1000).grad_reduce_in_fp32


def test_dataset_builder_flags_reach_megatron_cores_config(tiny_data, monkeypatch):
    from megatron_eod.training import eod_wiring
    from megatron_eod.training.data import build_tokenizer_from_args

    built = {}
    monkeypatch.setattr(eod_wiring, "build_gpt_datasets",
                        lambda *a, **settings: built.update(settings) or (None, None, None))
    args = parse_args(tiny_flags(tiny_data, "--num-dataset-builder-threads", "3",
                                 "--mid-level-dataset-surplus", "0.01",
                                 "--dataloader-fast-cache-load"),
                      world_size=1, cuda_available=False)
    eod_wiring.datasets(args, build_tokenizer_from_args(args), [8, 8, 8])
    assert (built["num_dataset_builder_threads"], built["mid_level_dataset_surplus"],
            built["fast_cache_load"], built["mmap_bin_files"]) == (3, 0.01, True, True)


def test_a_checkpoint_of_other_model_flags_is_refused_by_name(tiny_data, tmp_path):
    """Without the check the load went through: 1p norm weights (gamma - 1, near 0) read as
    gamma took a trained model's loss from 0.12 to 4.4; the QKV biases were dropped. Every
    difference is named (one save, one refused load: each flag on its own fails the same)."""
    from tests.training.test_checkpoint_formats import refused

    save = str(tmp_path / "ckpt")
    (result,) = run_ranks(_trained, 1, tiny_flags(
        tiny_data, "--train-iters", "3", "--save", save, "--apply-layernorm-1p",
        "--disable-bias-linear", "--add-qkv-bias", "--squared-relu", "--norm-epsilon", "1e-6",
        "--normalization", "RMSNorm"), daemon=False)
    assert result == 0
    line = refused(1, tiny_data, "--train-iters", "4", "--load", save, "--disable-bias-linear")
    for named in ("--apply-layernorm-1p True (this run: False)",
                  "--add-qkv-bias True (this run: False)",
                  "--squared-relu True (this run: False)",
                  "--norm-epsilon 1e-06 (this run: 1e-05)",
                  "--normalization RMSNorm (this run: LayerNorm)"):
        assert named in line


def _trained(rank, world, argv):
    from tests.training.test_nan_stop import _train

    return _train(rank, world, argv)[0]


def test_dist_ckpt_strictness_reaches_the_load(tiny_data, tmp_path):
    """A --load without the optimizer leaves the checkpoint's optimizer keys unread: fine by
    default (assume_ok_unexpected), refused naming them with raise_all, as megatron-core's
    StrictHandling says (it was accepted and ignored)."""
    from tests.training.test_checkpoint_formats import refused

    save = str(tmp_path / "ckpt")
    run_ranks(_trained, 1, tiny_flags(tiny_data, "--train-iters", "3", "--save", save),
              daemon=False)
    load = ("--train-iters", "4", "--load", save, "--no-load-optim")
    assert run_ranks(_trained, 1, tiny_flags(tiny_data, *load), daemon=False) == [0]
    line = refused(1, tiny_data, *load, "--dist-ckpt-strictness", "raise_all")
    assert "(--dist-ckpt-strictness raise_all): Some keys found in the checkpoint are " \
           "missing" in line and "optimizer.state.exp_avg" in line
