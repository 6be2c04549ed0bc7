"""The providers for Megatron-LM's trainer (training/providers.py), piece by piece: our flags
on its parser, the registry sized for the schedules, the stage tensors' packed shape, the
checks of each local loss, and Megatron-LM's args reaching the layer spec and the steps.
Megatron-LM's real `pretrain()` with them runs in tests/functional/.
"""

import argparse
import types

import pytest
import torch

from megatron_eod.megatron import cpu_compat
from megatron_eod.training.args import add_eod_args
from megatron_eod.training.providers import EodProviders
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import import_megatron_lm


def test_extra_args_and_distributed_marker():
    parser = add_eod_args(argparse.ArgumentParser())
    args = parser.parse_args(["--context-parallel-algo", "ulysses", "--ulysses-degree-in-cp", "4"])
    assert (args.context_parallel_algo, args.ulysses_degree_in_cp) == ("ulysses", 4)
    assert EodProviders().datasets_provider.is_distributed


def test_plans_ahead_in_every_rerun_mode_unless_told_not_to():
    """Planning ahead reads beneath Megatron-LM's rerun machine (plan_ahead.py), so its modes
    (validate_results by default) keep it; only --no-plan-ahead turns it off."""
    from megatron_eod.training.providers import plans_ahead

    args = add_eod_args(argparse.ArgumentParser()).parse_args([])
    for mode in ("disabled", "validate_results", "report_stats"):
        args.rerun_mode = mode
        assert plans_ahead(args) is True
    args.plan_ahead = False  # --no-plan-ahead
    assert plans_ahead(args) is False


@pytest.mark.parametrize("pp", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("chunks", [None, 2, 8])
@pytest.mark.parametrize("group", [None, 1, 5])
def test_registry_holds_every_context_megatron_core_schedules_keep(pp, chunks, group):
    """The batch contexts a rank needs at once are its forwards not yet run backward:
    megatron-core's own warm-up count (`get_pp_rank_microbatches`, every pipeline rank, many
    micro-batches) + the forward running + an evaluation's. The registry is at least that."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from megatron_eod.training.providers import contexts_in_flight

    if chunks is not None and pp == 1:
        pytest.skip("Megatron-LM needs pipeline-model-parallel-size > 1 for virtual stages")
    args = types.SimpleNamespace(pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=chunks,
                                 microbatch_group_size_per_vp_stage=group)
    bound = contexts_in_flight(args)
    most = 0
    for rank in range(pp):
        comm = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(size=lambda: pp, rank=lambda r=rank: r),
            virtual_pipeline_model_parallel_size=chunks)
        _, _, warmup, _ = get_pp_rank_microbatches(1000, chunks or 1, group or pp,
                                                   p2p_communicator=comm)
        most = max(most, warmup + 2)
    assert most <= bound
    if chunks is not None:  # exact for the interleaved schedule (its contexts stay on the GPU)
        assert bound == most


def test_pipeline_stage_buffers_are_shaped_as_the_packed_micro_batch():
    """Under PP, Megatron-LM's schedules are asked for the packed shape [mbs*s/cp, 1, h]
    (seq_length x mbs at micro-batch 1, decoder_seq_length too when given) by every schedule
    `get_forward_backward_func` returns, keyword or positional; micro-batch 1 unchanged;
    wrapping twice is wrapping once."""
    from megatron_eod.training.providers import pack_stage_shapes

    calls = []

    def schedule(forward_step_func, *, seq_length, micro_batch_size, decoder_seq_length=None,
                 forward_only=False):
        calls.append((seq_length, micro_batch_size, decoder_seq_length, forward_only))
        return "losses"

    training = types.SimpleNamespace(get_forward_backward_func=lambda **kw: schedule)
    pack_stage_shapes(training)
    wrapped = training.get_forward_backward_func
    pack_stage_shapes(training)
    assert training.get_forward_backward_func is wrapped
    run = training.get_forward_backward_func(schedule_pg_collection=None)
    assert run(print, seq_length=128, micro_batch_size=4, forward_only=True) == "losses"
    run(forward_step_func=print, seq_length=128, micro_batch_size=1)
    run(print, seq_length=64, micro_batch_size=2, decoder_seq_length=32)
    assert calls == [(512, 1, None, True), (128, 1, None, False), (128, 1, 64, False)]


def _checked_losses(rank, world):
    import argparse
    import logging

    from megatron_eod.training.providers import checked_loss

    cpu_compat.apply()  # as in a CPU run: megatron-core names the device in its message
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("megatron.core.rerun_state_machine").addHandler(handler)
    outcomes = []
    for nan_check, spiky in ((True, False), (False, False), (False, True)):
        args = argparse.Namespace(check_for_nan_in_loss_and_grad=nan_check,
                                  check_for_spiky_loss=spiky)
        loss = checked_loss(lambda out: (torch.tensor(out), torch.tensor(4), {}), args)
        assert loss(2.5)[0].item() == 2.5 and loss(2.5)[1].item() == 4
        try:
            loss(float("nan"))
            outcomes.append("trained on")
        except RuntimeError as error:
            outcomes.append(str(error))
    for _ in range(100):  # megatron-core learns the usual size from 100 losses, then judges
        loss(2.5)
    spikes = len([m for m in warned if "Spiky loss" in m])
    loss(30.0)
    return outcomes, (spikes, len([m for m in warned if "Spiky loss" in m]))


def test_each_local_loss_is_checked_as_megatron_lm_checks_it():
    """pretrain_gpt.py's own loss checks, through megatron-core's rerun state machine: a NaN
    local loss stops the run under --check-for-nan-in-loss-and-grad (a NaN evaluation loss
    went unnoticed), not without it; --check-for-spiky-loss judges every loss (it did
    nothing)."""
    ((stop, off, spiky), spikes), = run_ranks(_checked_losses, 1)
    assert "found NaN in local forward loss calculation" in stop
    assert off == spiky == "trained on"
    assert spikes == (0, 1)  # 30 after 2.5s: over 10x the usual


KEYS = ("rotary_percent", "rope_scaling", "rope_scaling_factor", "seq_len_interpolation_factor",
        "ring_exchange", "concurrent_calls", "fused_forward", "fused_backward")


@pytest.fixture(autouse=True, scope="module")
def _megatron_lm():
    """Megatron-LM's trainer on the path (a 0.16 checkout is not installed) and imported
    here, before the ranks fork: the ranks below import from it (a pytest-xdist worker may
    run this file first)."""
    import_megatron_lm()


def _wired(rank, world, flags):
    """Megatron-LM's args for `flags` (its parser and validate_args with our hooks), its config
    from them, and what our providers build of them."""
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_eod.megatron.batch_context import EodContextRegistry
    from megatron_eod.training import providers
    from tests.megatron.tiny_model import cp_setup
    from tests.training.test_run import validated

    with pytest.MonkeyPatch.context() as patch:
        args = validated(patch, *flags)
    with cp_setup(1):
        config = core_transformer_config_from_args(args)
        spec = providers.block_spec(EodContextRegistry(), config, args, False)
    attention = spec.layer_specs[0].submodules.self_attention.submodules
    steps = providers.steps(args, EodContextRegistry(), 0, None, plan_ahead=False)
    return {"params": {k: attention.core_attention.params[k] for k in KEYS},
            "fused_tiles": steps.flags["fused_tiles"],
            "qk_norm": attention.q_layernorm is not None, "qk_config": config.qk_layernorm,
            "interleaved": config.rotary_interleaved,
            "gpt_positions": providers.gpt_position_embedding_type(args)}


def test_megatron_lm_flags_reach_the_spec_and_the_config(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # --cp-fused-forward's way on a CPU (tests)
    (wired,) = run_ranks(_wired, 1, [
        "--position-embedding-type", "rope", "--qk-layernorm", "--rotary-interleaved",
        "--use-rope-scaling", "--rope-scaling-factor", "16",
        "--rotary-seq-len-interpolation-factor", "2", "--rotary-percent", "0.5",
        "--context-parallel-size", "4", "--cp-ring-exchange", "batched-keep",
        "--cp-concurrent-calls", "--cp-fused-forward", "--cp-fused-backward"])
    assert wired == {"params": {"rotary_percent": 0.5, "rope_scaling": True,
                                "rope_scaling_factor": 16.0,
                                "seq_len_interpolation_factor": 2.0,
                                "ring_exchange": "batched-keep", "concurrent_calls": True,
                                "fused_forward": True, "fused_backward": True},
                     "fused_tiles": True,  # the plans carry what the fused kernels read
                     "qk_norm": True, "qk_config": True, "interleaved": True,
                     "gpt_positions": "none"}


def test_positions_other_than_rope_turn_rope_off():
    for kind in ("learned_absolute", "none"):
        (wired,) = run_ranks(_wired, 1, ["--position-embedding-type", kind])
        assert wired["params"]["rotary_percent"] == 0.0
        assert wired["gpt_positions"] == kind
        assert not wired["fused_tiles"]  # without --cp-fused-forward: no tiles to build
