"""Run a CP plan's attention in ONE process: every ring group's kernel calls, no process group.

One job: check and time a plan's per-group compute on a single device. A GPU machine with one
GPU cannot run NCCL ranks side by side, yet the plan, the kernel calls, the log-sum-exp
merges and the key/value gradient returns are what decide correctness and speed there; this
module runs them group after group, with the "received" key/value rows gathered from the full
tensors instead of sent. Used by the GPU tests and by tools/bench_cp_gpu.py.

    sim = SimulatedPlan(plan, q_NHD, k_NGD, v_NGD, dout_NHD)   # gathers, outside any timing
                                     # (exchange="steps": ring.py's per-step executor;
                                     # concurrent_calls=True: batched.py's two streams)
    result = sim.run_group(g)        # group g's forward + backward compute only (time this)
    out, lse = sim.forward_group(g)  # its forward alone
    out, dq, dk, dv = sim.run()      # all groups, scattered back to stream order

The compute is the ring executors' own code (batched.py's `batched_forward`/`_backward` by
default, ring.py's `ring_forward`/`ring_backward` with exchange="steps") with an in-process
transport.
What it does not do: no communication and no overlap (that is ring.py's job), no Ulysses
all-to-all: a Hybrid/Ulysses group computes all heads here, so its time stands for its u
ranks together.

Shape key: N = stream tokens, T = a group's rows, H = heads, G = key/value heads, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from megatron_eod.attention.backends import accumulation_dtype, default_scale, get_backend
from megatron_eod.attention.batched import batched_backward, batched_forward
from megatron_eod.attention.ring import (BATCHED, check_ring_exchange, executor_for,
                                         ring_backward, ring_forward, stack_kv)

__all__ = ["SimulatedPlan", "GroupResult", "InProcessTransport", "Ready"]


@dataclass
class GroupResult:
    rows: torch.Tensor  # int64 [T]: stream rows of the group, in its local order
    out: torch.Tensor  # [T, H, D]
    dq: torch.Tensor  # [T, H, D]
    dk: torch.Tensor  # [T, G, D], local rows only
    dv: torch.Tensor
    returned: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (stream rows, dk, dv)


class Ready:
    """A transfer already done: `wait()` returns its result."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class InProcessTransport:
    """Hands out the key/value rows gathered up front; keeps the gradients sent back."""

    def __init__(self, received, received_rows):
        self.received, self.received_rows, self.returned = received, received_rows, []

    def start_all_kv(self, schedule, k_TGD, v_TGD):
        return Ready(self.received[-1])

    def start_all_grad(self, schedule, gk_NGD, gv_NGD, row_shape, dtype, device):
        if gk_NGD is not None:
            self.returned.append((self.received_rows[-1], gk_NGD, gv_NGD))
        return Ready(None)

    def start_kv(self, step, kv_2TGD):
        return Ready(self.received[step.step - 1])

    def start_grad(self, step, grad_2NGD, row_shape, dtype, device):
        if grad_2NGD is not None:
            self.returned.append((self.received_rows[step.step - 1], *grad_2NGD))
        return Ready(None)  # gradients of rows this group sent are landed by run()


class SimulatedPlan:
    transport_type = InProcessTransport  # tools/count_launches.py also lands returned rows

    def __init__(self, plan, q_NHD, k_NGD, v_NGD, dout_NHD, backend=None, softmax_scale=None,
                 exchange="batched", concurrent_calls=False):
        check_ring_exchange(exchange)
        self.exchange, self.concurrent_calls = exchange, concurrent_calls
        device = q_NHD.device
        self.backend = backend or get_backend(device, q_NHD.dtype)
        self.scale = softmax_scale or default_scale(q_NHD.shape[-1])
        self.shape = (q_NHD.shape, k_NGD.shape)
        self.schedules = [s.to(device) for s in plan.schedules]
        self.rows = [torch.from_numpy(plan.pieces.token_index(g)).to(device)
                     for g in range(plan.ring_size)]
        kv_2NGD = torch.stack([k_NGD, v_NGD])
        self.inputs = []
        for g, schedule in enumerate(self.schedules):
            rows = self.rows[g]
            received, received_rows = [], []
            for step in schedule.steps:
                sender = self.schedules[step.recv_from].steps[step.step - 1]
                if sender.send_to != g:
                    raise AssertionError("plan schedules disagree on who sends to whom")
                stream_rows = self.rows[step.recv_from][sender.send_index]
                received.append(kv_2NGD[:, stream_rows] if stream_rows.numel() else None)
                received_rows.append(stream_rows)
            if schedule.batched is not None:  # last: the batched buffer, [2, N, G, D]
                received_rows.append(self._batched_rows(g))
                received.append(kv_2NGD[:, received_rows[-1]])
            self.inputs.append((q_NHD[rows], k_NGD[rows], v_NGD[rows], dout_NHD[rows],
                                received, received_rows))

    def _batched_rows(self, g: int) -> torch.Tensor:
        """Stream rows of group g's batched receive buffer: each message as its sender's
        message of the same ordinal to g holds them."""
        parts = [torch.zeros(0, dtype=torch.int64, device=self.rows[g].device)]
        for m in self.schedules[g].batched.recvs:
            sender = self.schedules[m.peer].batched
            sent = [s for s in sender.sends if s.peer == g and s.ordinal == m.ordinal]
            if len(sent) != 1 or sent[0].stop - sent[0].start != m.stop - m.start:
                raise AssertionError("plan schedules disagree on a batched message")
            parts.append(self.rows[m.peer][sender.send_index[sent[0].start:sent[0].stop]])
        return torch.cat(parts)

    def forward_group(self, g: int):
        """Group g's forward compute alone: (out, lse), as the ring executor makes them."""
        q, k, v, _, received, received_rows = self.inputs[g]
        transport = self.transport_type(received, received_rows)
        schedule = self.schedules[g]
        if executor_for(schedule, self.exchange) in BATCHED:
            return batched_forward(q, k, v, schedule, transport, self.backend, self.scale,
                                   concurrent_calls=self.concurrent_calls)
        return ring_forward(q, k, v, schedule, transport, self.backend, self.scale,
                            stack_kv(k, v, schedule))

    def run_group(self, g: int) -> GroupResult:
        """Group g's forward and backward compute, exactly as the ring executor runs it."""
        q, k, v, dout, received, received_rows = self.inputs[g]
        transport = self.transport_type(received, received_rows)
        schedule, backend, scale = self.schedules[g], self.backend, self.scale
        exchange = executor_for(schedule, self.exchange)
        if exchange in BATCHED:
            keep = exchange == "batched-keep"
            out, lse, *kept = batched_forward(q, k, v, schedule, transport, backend, scale, keep,
                                              self.concurrent_calls)
            dq, dk, dv = batched_backward(dout, q, k, v, out, lse, schedule, transport, backend,
                                          scale, keep, *kept,
                                          concurrent_calls=self.concurrent_calls)
        else:
            kv = stack_kv(k, v, schedule)  # once per group, as ring_attention does
            out, lse = ring_forward(q, k, v, schedule, transport, backend, scale, kv)
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, schedule, transport, backend,
                                       scale, kv)
        return GroupResult(self.rows[g], out, dq, dk, dv, transport.returned)

    def run(self):
        """(out, dq, dk, dv) over the whole stream, in stream order."""
        (q_shape, k_shape), device = self.shape, self.rows[0].device
        dtype = self.inputs[0][0].dtype
        acc = accumulation_dtype(dtype)
        out = torch.zeros(q_shape, dtype=dtype, device=device)
        dq = torch.zeros(q_shape, dtype=dtype, device=device)
        dkv = torch.zeros((k_shape[0], 2) + tuple(k_shape[1:]), dtype=acc, device=device)
        for g in range(len(self.schedules)):
            result = self.run_group(g)
            out[result.rows], dq[result.rows] = result.out, result.dq
            dkv[:, 0].index_add_(0, result.rows, result.dk.to(acc))
            dkv[:, 1].index_add_(0, result.rows, result.dv.to(acc))
            for rows, gk, gv in result.returned:
                dkv[:, 0].index_add_(0, rows, gk.to(acc))
                dkv[:, 1].index_add_(0, rows, gv.to(acc))
        return out, dq, dkv[:, 0].to(dtype), dkv[:, 1].to(dtype)
