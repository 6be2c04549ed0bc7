"""One rank of the multi-process CUDA attention check (issue 11 item 4): several processes on
ONE GPU, gloo with transfers staged through host memory (comm.host_staging). Launched by
tests/attention/test_multiprocess_gpu.py through torchrun:

    torchrun --nproc-per-node N -m tests.attention.shared_gpu_worker OUT_DIR ALGO DEGREE

For a few random layouts and both ring executors (ring_exchange; batched also with
concurrent_calls, two CUDA streams), the rank's rows through
`context_parallel_attention` in bf16 on the GPU are compared with (a) the float64 dense
document-masked reference and (b) the same kernel over the whole rows in one process (CP=1,
bf16): out, dq, dk, dv, each as max |diff| over max |reference|. Writes OUT_DIR/rank{R}.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_eod import (build_doc_layout, context_parallel_attention, create_hybrid_groups,
                          plan_context_parallel)
from megatron_eod.attention.comm import host_staging
from tests.reference import dense_document_attention, random_layout_tokens

EOD, HEADS, KV_HEADS, DIM = 50, 8, 2, 64
LAYOUTS = [("mixed", 2, 512), ("spanning", 1, 1024), ("short", 4, 256)]


def _rows_through(plan, idx, q, k, v, dout, group, executor="batched"):
    """bf16 on the GPU: this rank's rows of out, dq, dk, dv (float64 on the CPU);
    executor: a ring exchange, "+concurrent" for concurrent_calls."""
    exchange, _, concurrent = executor.partition("+")
    ql, kl, vl = (t[idx].to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, plan, group=group, ring_exchange=exchange,
                                     concurrent_calls=bool(concurrent))
    (out * dout[idx].to("cuda", torch.bfloat16)).sum().backward()
    return [t.detach().double().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]


def main(out_dir, algo, degree):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    if algo == "hybrid":
        create_hybrid_groups(dist.group.WORLD, degree)
    results = []
    with host_staging():
        for i, (kind, b, s) in enumerate(LAYOUTS):
            layout = build_doc_layout(random_layout_tokens(kind, b, s, EOD, 100 + i), EOD)
            gen = torch.Generator().manual_seed(200 + i)
            n = b * s
            q = torch.randn(n, HEADS, DIM, generator=gen, dtype=torch.float64)
            k = torch.randn(n, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
            v = torch.randn(n, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
            dout = torch.randn(n, HEADS, DIM, generator=gen, dtype=torch.float64)
            plan = plan_context_parallel(layout.cu_seqlens, world, algo, degree)
            idx = plan.token_index(rank)
            whole = plan_context_parallel(layout.cu_seqlens, 1, "ring")
            cp1 = _rows_through(whole, whole.token_index(0), q, k, v, dout, singles[rank])
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            ref = dense_document_attention(qr, kr, vr, layout.cu_seqlens, DIM ** -0.5)
            (ref * dout).sum().backward()
            exact = [ref.detach(), qr.grad, kr.grad, vr.grad]
            for exchange in (("batched", "steps", "batched+concurrent") if algo != "ulysses"
                             else ("batched",)):
                mine = _rows_through(plan, idx, q, k, v, dout, dist.group.WORLD, exchange)
                record = {"layout": kind, "exchange": exchange}
                for name, m, c, e in zip(("out", "dq", "dk", "dv"), mine, cp1, exact):
                    scale = e.abs().max().item()
                    record[f"{name}_vs_float64"] = (m - e[idx]).abs().max().item() / scale
                    record[f"{name}_vs_cp1"] = (m - c[idx]).abs().max().item() / scale
                results.append(record)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) or None)
