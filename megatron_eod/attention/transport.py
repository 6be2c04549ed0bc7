"""Who moves a ring group's key/value rows and their gradients: `GroupTransport`.

One job: start the transfers of a group's ring steps over a process group, step by step
(ring.py: `start_kv`, `start_grad`) or all at once (batched.py: `start_all_kv`,
`start_all_grad`), and hand back what arrives. The executors take any object with these
methods: simulate.py's in-process transport runs the very same executors on one device.

Every rank walks ALL ring steps in the same order, even those where it sends and receives
nothing: transfers between a pair of ranks are then started in the same order on both sides,
which NCCL needs (it matches point-to-point messages by order, not by tag). Tags tell
key/value transfers from gradient returns (gloo uses them), and number the batched
exchange's messages between a pair (`Message.ordinal`: a peer may send several).

What it does not do: no attention math; the group must be warmed up first (comm.warm_up).
"""

from __future__ import annotations

import torch

from megatron_eod.attention.comm import exchange, exchange_many

__all__ = ["GroupTransport"]

_GRAD_TAG = 1 << 16


class GroupTransport:
    """Ring step transfers over a process group (ranks of `group` are ring groups)."""

    def __init__(self, group):
        self.group = group

    def start_kv(self, step, kv_2TGD):
        if step.send_span == (0, kv_2TGD.shape[1]):
            send = kv_2TGD  # every local row, in order: no copy
        else:
            send = kv_2TGD[:, step.send_index] if step.send_index.numel() else None
        shape = (2, step.recv_count) + tuple(kv_2TGD.shape[2:])
        return exchange(send, step.send_to, shape, step.recv_from, self.group, kv_2TGD.dtype,
                        kv_2TGD.device, tag=step.step)

    def start_grad(self, step, grad_2NGD, row_shape, dtype, device):
        """Send the gradients of rows received at `step` back; receive those of rows sent."""
        shape = (2, step.send_index.numel()) + tuple(row_shape)
        return exchange(grad_2NGD, step.recv_from, shape, step.send_to, self.group, dtype,
                        device, tag=_GRAD_TAG + step.step)

    # The batched exchange (batched.py): all messages in one batched p2p call, each a
    # contiguous slice of one [rows, 2, G, D] buffer, listed in the plan's order (a pair's
    # messages in the receiver's buffer order on both sides), tagged by their ordinal.

    def start_all_kv(self, schedule, send_S2GD):
        batched = schedule.batched
        recv_N2GD = send_S2GD.new_empty((batched.recv_count,) + tuple(send_S2GD.shape[1:]))
        return self._start_all(batched.sends, send_S2GD, batched.recvs, recv_N2GD, 0)

    def start_all_grad(self, schedule, grad_N2GD, row_shape, dtype, device):
        """Send the gradients of received rows back (in the messages that brought the rows);
        receive those of rows sent. `dtype`: the gradients' (the kernel's) dtype."""
        batched = schedule.batched
        if grad_N2GD is None:  # nothing received (every received row is read by the call)
            grad_N2GD = torch.zeros((0, 2) + tuple(row_shape), dtype=dtype, device=device)
        returned_S2GD = torch.empty((batched.send_index.numel(), 2) + tuple(row_shape),
                                    dtype=dtype, device=device)
        return self._start_all(batched.recvs, grad_N2GD, batched.sends, returned_S2GD,
                               _GRAD_TAG)

    def _start_all(self, send_messages, send, recv_messages, recv, tag):
        """One batched call; its `wait()` returns `recv`, filled."""
        sends = [(send[m.start:m.stop], m.peer, tag + m.ordinal) for m in send_messages]
        recvs = [(recv[m.start:m.stop], m.peer, tag + m.ordinal) for m in recv_messages]
        return exchange_many(sends, recvs, self.group, result=recv)
