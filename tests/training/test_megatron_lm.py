"""The providers for Megatron-LM's trainer (training/megatron_lm.py) in-process, against a
stand-in for `megatron.training` that supplies `get_args` (our parsed flags with Megatron-LM's
extra fields), `get_tokenizer` and `core_transformer_config_from_args`: fast checks of the
providers alone (CP=2 ring and CP=4 hybrid give the CP=1 loss to 1e-5) that need no
Megatron-LM checkout. Megatron-LM's real `pretrain()` and parser run in
test_megatron_lm_pretrain.py and test_megatron_lm_args.py.
"""

import argparse
import sys
import types

import pytest
import torch
import torch.distributed as dist

from megatron_eod.data.tokenizers import ByteTokenizer, padded_vocab_size
from megatron_eod.megatron import cpu_compat
from megatron_eod.megatron.dataset import parse_data_path
from megatron_eod.training.args import FlagError, parse_args
from megatron_eod.training.data import MicroBatches
from megatron_eod.training.megatron_lm import EodProviders
from megatron_eod.training.megatron_lm_args import add_eod_args, eod_args_from_megatron
from megatron_eod.training.model import transformer_config
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks


def megatron_lm_args(data, world, *extra):
    """Our parsed flags, made to look like Megatron-LM's args before our checks ran."""
    args = parse_args(tiny_flags(data, "--context-parallel-size", str(world), *extra),
                      world_size=world, cuda_available=False)
    del args.ulysses_degree  # set by our checks; the providers must derive it themselves
    args.padded_vocab_size = padded_vocab_size(ByteTokenizer().vocab_size, 128, 1)
    args.transformer_impl = "local"
    args.gradient_accumulation_fusion = False  # as --no-gradient-accumulation-fusion (no apex)
    args.calculate_per_token_loss = True
    u = args.ulysses_degree_in_cp
    args.hierarchical_context_parallel_sizes = [u, world // u] if u else None
    args.cp_comm_type = ["a2a+p2p"] if u else None
    return args


def install_stand_in(args):
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    training.get_tokenizer = ByteTokenizer
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.core_transformer_config_from_args = transformer_config
    training.arguments = arguments
    utils = types.ModuleType("megatron.training.utils")  # --data-path only, as these args have
    utils.get_blend_and_blend_per_split = lambda a: (parse_data_path(a.data_path), None)
    training.utils = utils
    sys.modules["megatron.training"] = training
    sys.modules["megatron.training.arguments"] = arguments
    sys.modules["megatron.training.utils"] = utils


def _first_loss(rank, world, data, extra):
    from megatron.core import parallel_state, tensor_parallel

    args = megatron_lm_args(data, world, *extra)
    install_stand_in(args)
    cpu_compat.apply()
    parallel_state.initialize_model_parallel(
        context_parallel_size=world,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        providers = EodProviders()
        # Megatron-LM's get_model passes config= and pg_collection= as keywords.
        model = providers.model_provider(pre_process=True, post_process=True, config=None,
                                         pg_collection=None)
        train, _, _ = providers.datasets_provider([8, 0, 0])
        output, loss_fn = providers.forward_step(MicroBatches(train, 2, 0, 1), model)
        loss_sum, tokens, report = loss_fn(output)
        loss_sum.backward()
        totals = report["lm loss"].detach()
        if world > 1:
            dist.all_reduce(totals, group=parallel_state.get_context_parallel_group())
        return (totals[0] / totals[1]).item(), args.context_parallel_algo
    finally:
        parallel_state.destroy_model_parallel()
        cpu_compat.remove()


@pytest.mark.parametrize("world,extra", [
    (2, ["--context-parallel-algo", "ring"]),
    (4, ["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2"])],
    ids=["ring2", "hybrid2x2"])
def test_providers_give_the_cp1_loss(short_docs_data, world, extra):
    reference, _ = run_ranks(_first_loss, 1, short_docs_data, [])[0]
    for loss, algo in run_ranks(_first_loss, world, short_docs_data, extra):
        assert loss == pytest.approx(reference, rel=1e-5)
        assert algo == extra[1].replace("_cp_algo", "")


def test_hybrid_from_ulysses_degree_alone_fills_megatron_hierarchical_sizes(short_docs_data):
    """One fact asked once: --ulysses-degree-in-cp alone gives Megatron-LM the sizes."""
    args = megatron_lm_args(short_docs_data, 4, "--context-parallel-algo", "hybrid",
                            "--ulysses-degree-in-cp", "2")
    args.hierarchical_context_parallel_sizes, args.cp_comm_type = None, None
    eod_args_from_megatron(args)
    assert args.hierarchical_context_parallel_sizes == [2, 2]
    assert args.cp_comm_type == ["a2a+p2p"] and args.ulysses_degree == 2


def test_cp_rules_apply_to_megatron_lm_args(short_docs_data):
    args = megatron_lm_args(short_docs_data, 4, "--context-parallel-algo", "ring")
    args.context_parallel_algo = "zigzag"
    with pytest.raises(FlagError, match="--context-parallel-algo 'zigzag'"):
        eod_args_from_megatron(args)


def test_extra_args_and_distributed_marker():
    parser = add_eod_args(argparse.ArgumentParser())
    args = parser.parse_args(["--context-parallel-algo", "ulysses", "--ulysses-degree-in-cp", "4"])
    assert (args.context_parallel_algo, args.ulysses_degree_in_cp) == ("ulysses", 4)
    assert EodProviders().datasets_provider.is_distributed


def test_plans_ahead_only_where_megatron_lm_replays_nothing(capsys):
    """Megatron-LM's rerun state machine (--rerun-mode validate_results, its default) saves
    each iteration's micro-batches to replay them; a batch read ahead belongs to the next
    iteration, so the providers plan in the step there, and say so."""
    from megatron_eod.training.megatron_lm import plans_ahead

    args = add_eod_args(argparse.ArgumentParser()).parse_args([])
    assert args.plan_ahead  # our flag's default
    args.rank = 0
    for mode, ahead in (("disabled", True), ("validate_results", False),
                        ("report_stats", False)):
        args.rerun_mode = mode
        assert plans_ahead(args) is ahead
    assert "--rerun-mode disabled to plan ahead" in capsys.readouterr().out
    args.rerun_mode, args.plan_ahead = "disabled", False  # --no-plan-ahead
    assert plans_ahead(args) is False


@pytest.mark.parametrize("pp", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("chunks", [None, 2, 8])
@pytest.mark.parametrize("group", [None, 1, 5])
def test_registry_holds_every_context_megatron_core_schedules_keep(pp, chunks, group):
    """The batch contexts a rank needs at once are its forwards not yet run backward:
    megatron-core's own warm-up count (`get_pp_rank_microbatches`, every pipeline rank, many
    micro-batches) + the forward running + an evaluation's. The registry is at least that."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from megatron_eod.training.megatron_lm import contexts_in_flight

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
    from megatron_eod.training.megatron_lm import pack_stage_shapes

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

    from megatron_eod.training.megatron_lm import checked_loss

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
