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

    # The batched exchange (batched.py): all messages in one batched p2p call, listed in the
    # plan's order (a pair's messages in the receiver's buffer order on both sides), keys
    # then values of each, tagged 2 x ordinal (+ 1 for values). A sent message is a run of
    # local rows, so k and v go as views: nothing is gathered or stacked to send.

    def start_all_kv(self, schedule, k_TGD, v_TGD):
        """Send every sent message's k and v rows; receive into one [2, N, G, D] buffer."""
        batched = schedule.batched
        recv_2NGD = k_TGD.new_empty((2, batched.recv_count) + tuple(k_TGD.shape[1:]))
        sends = [(x[m.row:m.row + m.stop - m.start], m, i) for m in batched.sends
                 for i, x in enumerate((k_TGD, v_TGD))]
        recvs = [(recv_2NGD[i, m.start:m.stop], m, i) for m in batched.recvs for i in (0, 1)]
        return self._start_all(sends, recvs, 0, recv_2NGD)

    def start_all_grad(self, schedule, gk_NGD, gv_NGD, row_shape, dtype, device):
        """Send the gradients of received rows back (in the messages that brought the rows);
        receive those of rows sent, into [2, S, G, D]. `dtype`: the kernel's."""
        batched = schedule.batched
        returned_2SGD = torch.empty((2, batched.send_index.numel()) + tuple(row_shape),
                                    dtype=dtype, device=device)
        sends = [] if gk_NGD is None else [
            (g[m.start:m.stop], m, i) for m in batched.recvs
            for i, g in enumerate((gk_NGD, gv_NGD))]
        recvs = [(returned_2SGD[i, m.start:m.stop], m, i) for m in batched.sends for i in (0, 1)]
        return self._start_all(sends, recvs, _GRAD_TAG, returned_2SGD)

    def _start_all(self, sends, recvs, tag, result):
        """One batched call of (tensor, message, 0 for keys / 1 for values) parts; its
        `wait()` returns `result`, filled."""
        tagged = lambda parts: [(x, m.peer, tag + 2 * m.ordinal + i)  # noqa: E731
                                for x, m, i in parts]
        return exchange_many(tagged(sends), tagged(recvs), self.group, result=result)
