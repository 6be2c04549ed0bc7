"""MasterAdam's float32 master weights follow loaded weights (bf16/fp16 runs), and the fp16
loss scaler's state survives a checkpoint round trip."""

import argparse

import torch

from megatron_eod.training.optimizer import MasterAdam
from tests.harness import run_ranks


def _args(**overrides):
    base = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.0,
                clip_grad=1.0, bf16=True, fp16=False)
    return argparse.Namespace(**{**base, **overrides})


def _with_parallel_state(fn):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        return fn()
    finally:
        parallel_state.destroy_model_parallel()


def _loaded_weights_survive_a_step(rank, world):
    def body():
        model = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
        optimizer = MasterAdam(model, _args())
        with torch.no_grad():
            model.weight.fill_(7.0)  # what load_state_dict does to the model
        optimizer.reload_model_params()
        model.weight.grad = torch.zeros_like(model.weight)
        optimizer.step()
        return model.weight.float()
    return _with_parallel_state(body)


def test_masters_follow_the_loaded_weights():
    weight = run_ranks(_loaded_weights_survive_a_step, 1)[0]
    assert torch.all(weight == 7.0)


def _scaler_round_trip(rank, world):
    def body():
        model = torch.nn.Linear(2, 2)
        first = MasterAdam(model, _args(bf16=False, fp16=True))
        first.scaler.scale, first.scaler.clean = 1024.0, 999
        second = MasterAdam(model, _args(bf16=False, fp16=True))
        second.load_state_dict(first.state_dict())
        return second.scaler.scale, second.scaler.clean
    return _with_parallel_state(body)


def test_fp16_loss_scaler_state_round_trips():
    assert run_ranks(_scaler_round_trip, 1)[0] == (1024.0, 999)
