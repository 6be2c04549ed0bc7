"""The MoE and MLA flags refused beside EoD attention (training/model_flags.py), on
Megatron-LM's own parsed args; the runs themselves: tests/functional/test_moe_training.py,
test_mla_training.py."""

import pytest

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.model_flags import check_mla, check_moe
from tests.training.megatron_lm_checkout import megatron_lm_knows
from tests.training.parsed_flags import checked, megatron_lm_args


def _needs_hybrid_flag():
    if not megatron_lm_knows("--hybrid-layer-pattern"):
        pytest.skip("this Megatron-LM has no --hybrid-layer-pattern (added in 0.17)")

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


def test_a_moe_model_passes_and_keeps_its_flags():
    args = checked(*MOE, "--context-parallel-size", "4")
    assert args.num_experts == 4 and args.moe_router_topk == 2


@pytest.mark.parametrize("flags,cuda,message", [
    (["--moe-router-load-balancing-type", "seq_aux_loss"], False,
     r"seq_aux_loss with --micro-batch-size 2: .* one sequence"),
    (["--moe-grouped-gemm"], False, r"--moe-grouped-gemm needs CUDA"),
])
def test_refused_model_flags_are_named(flags, cuda, message):
    args = megatron_lm_args(*MOE, *flags)
    with pytest.raises(FlagError, match=message):
        check_moe(args, cuda)


def test_sequential_experts_with_biases_are_refused_before_megatron_core_stops():
    """megatron-core 0.16-0.19's SequentialMLP adds the bias in place on the view its TP=1
    reduce returns: a RuntimeError at the first step on every rank (seen on 0.19.2)."""
    with pytest.raises(FlagError, match=r"--num-experts 4 with biases .* --disable-bias-linear"):
        checked("--num-experts", "4")
    args = megatron_lm_args("--num-experts", "4")
    with pytest.raises(FlagError, match=r"or --moe-grouped-gemm$"):
        check_moe(args, True)
    check_moe(megatron_lm_args("--num-experts", "4", "--moe-grouped-gemm"), True)


def test_seq_aux_loss_at_one_row_per_micro_batch_passes():
    check_moe(megatron_lm_args(*MOE, "--moe-router-load-balancing-type", "seq_aux_loss",
                               "--micro-batch-size", "1"), False)


def test_mla_on_megatron_core_0_16_without_transformer_engine_is_refused(monkeypatch):
    import importlib.util

    import megatron.core

    args = megatron_lm_args("--multi-latent-attention")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else object())
    monkeypatch.setattr(megatron.core, "__version__", "0.16.1")
    with pytest.raises(FlagError, match=r"megatron-core 0.16.1 needs TransformerEngine"):
        check_mla(args)
    monkeypatch.setattr(megatron.core, "__version__", "0.17.1")
    check_mla(args)


@pytest.mark.parametrize("pattern,message", [
    ("*-M-", r"'M': Mamba-2 layers carry a state .* restart at every document"),
    ("*-G-", r"'G': Gated DeltaNet"),
    ("D-D-", r"'D': DeepSeek sparse attention"),
    ("+-+-", r"'\+': MLA layers in a hybrid stack are not wired"),
    ("*-*-/*-", r"'/': multi-token prediction in a hybrid stack"),
    ("*-x-", r"'x' is not a layer symbol pretrain_hybrid.py builds"),
])
def test_hybrid_layers_eod_reset_cannot_run_are_refused_by_symbol(pattern, message):
    from megatron_eod.training.model_flags import check_hybrid_pattern

    _needs_hybrid_flag()
    args = megatron_lm_args("--hybrid-layer-pattern", pattern)
    args.eod_model = "hybrid"
    with pytest.raises(FlagError, match=message):
        check_hybrid_pattern(args)


def test_the_entry_and_the_pattern_go_together():
    from megatron_eod.training.model_flags import check_hybrid_pattern

    _needs_hybrid_flag()
    args = megatron_lm_args("--hybrid-layer-pattern", "*-*E")
    with pytest.raises(FlagError, match=r"builds Megatron-LM's HybridModel: launch "
                                        r"pretrain_hybrid.py"):
        check_hybrid_pattern(args)  # pretrain_gpt.py
    args.eod_model = "hybrid"
    check_hybrid_pattern(args)
    args = megatron_lm_args()
    args.eod_model = "hybrid"
    with pytest.raises(FlagError, match=r"pretrain_hybrid.py needs --hybrid-layer-pattern"):
        check_hybrid_pattern(args)
