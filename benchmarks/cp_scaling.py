"""CP scaling on the debug model:

    python benchmarks/cp_scaling.py [--seq-lens 4096,8192] [--cps 1,2,4]

For cp = 1, 2, 4, each cp_comm_type and each total sequence length, one row of `batch 1`:
step time of forward + backward (the slowest rank; no FSDP and no optimizer, so the table
isolates CP), what autograd saves for backward per rank, the bytes each rank sends for the CP
attention per step (counted by wrapping torch.distributed's collectives) beside the analytic
value, and the attention-work balance max/mean over the CP ranks. Each cp runs in its own
group of cp processes on this machine.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from _group import run_group
from torch.distributed.device_mesh import init_device_mesh

from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.layout import build_layout
from titan_vlm.metrics import SavedForBackward
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.models.llava.model import VLM
from titan_vlm.parallel.context_parallel import CPOptions
from titan_vlm.parallel.cp_attention import CP_ATTENTION, a2a_kv_heads
from titan_vlm.parallel_dims import MESH_DIMS, Mesh
from titan_vlm.step import forward_backward


@contextmanager
def count_sent_bytes():
    """Patch the collectives the CP attention uses; yield a dict that sums bytes this rank sends."""
    sent = {"bytes": 0}
    originals = {
        name: getattr(dist, name)
        for name in (
            "all_gather_single",
            "reduce_scatter_single",
            "all_to_all_single",
            "batch_isend_irecv",
        )
    }

    def size(group):
        return dist.get_world_size(group)

    def all_gather_single(out, x, group=None, **kw):
        sent["bytes"] += (size(group) - 1) * x.nbytes  # a ring all-gather forwards P-1 pieces
        return originals["all_gather_single"](out, x, group=group, **kw)

    def reduce_scatter_single(out, x, group=None, **kw):
        sent["bytes"] += x.nbytes * (size(group) - 1) // size(group)
        return originals["reduce_scatter_single"](out, x, group=group, **kw)

    def all_to_all_single(out, x, group=None, **kw):
        sent["bytes"] += x.nbytes * (size(group) - 1) // size(group)
        return originals["all_to_all_single"](out, x, group=group, **kw)

    def batch_isend_irecv(ops):
        sent["bytes"] += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return originals["batch_isend_irecv"](ops)

    for name, fn in (
        ("all_gather_single", all_gather_single),
        ("reduce_scatter_single", reduce_scatter_single),
        ("all_to_all_single", all_to_all_single),
        ("batch_isend_irecv", batch_isend_irecv),
    ):
        setattr(dist, name, fn)
    try:
        yield sent
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def analytic_bytes(
    comm: str, cp: int, n_img: int, t_local: int, flavor: str, batch: int, elem: int = 4
) -> int:
    """Bytes one rank sends per step for the CP attention, from the design (all decoder layers):
    `n_img` image slots and `t_local` text slots per rank."""
    if cp == 1:
        return 0
    d = get_flavor(flavor).decoder
    kv = 2 * batch * d.n_kv_heads * t_local * d.head_dim  # this rank's text K and V, elements
    if comm == "p2p":  # K/V go P-1 hops each way; the fp32 dK/dV accumulators P-1 hops too
        per_layer = (cp - 1) * kv * elem * 2 + (cp - 1) * kv * 4
    elif comm == "allgather":  # all-gather K/V; reduce-scatter fp32 dK/dV of the whole text
        per_layer = (cp - 1) * kv * elem + (cp - 1) * kv * 4
    else:  # a2a: q, k, v and out (and their grads) move (P-1)/P; image outputs all-gathered by head
        kv_heads = cp * len(a2a_kv_heads(d.n_heads, d.n_kv_heads, cp)[0])  # replicas counted
        text = batch * t_local * d.head_dim * (2 * d.n_heads + 2 * kv_heads) * elem
        image = batch * n_img * d.head_dim * d.n_heads * elem
        per_layer = 2 * (text + image) * (cp - 1) // cp
    return per_layer * d.n_layers


def worker(rank: int, cp: int, results, configs: list, flavor: str) -> None:
    mesh = Mesh.from_root(init_device_mesh("cpu", (1, 1, 1, cp, 1), mesh_dim_names=MESH_DIMS))
    args = get_flavor(flavor)
    torch.manual_seed(0)
    model = VLM(args)
    for comm, seq_len in configs:
        data = SyntheticCaptions(
            args.vision.image_size,
            args.tokens_per_image,
            seq_len,
            0,
            sentences_per_image=seq_len // 8,
        )
        batch = data.batch(0, 0, 1, 1)
        _, layout = build_layout(batch.doc, batch.image, cp, 0)
        # the one long sample split head-tail with its images on every rank: the layout the
        # analytic column prices (the config's "auto" placements split it the same way but may
        # shard its image slots: benchmarks/cp_layouts.py compares placements)
        options = CPOptions(comm, sample_placement="split", image_tokens="replicate")
        with count_sent_bytes() as sent, SavedForBackward(model.parameters()) as saved:
            forward_backward(model, batch, mesh, options)  # warm-up, counted
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        forward_backward(model, batch, mesh, options)
        elapsed = torch.tensor(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        stats = torch.tensor([saved.bytes, sent["bytes"]], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put(
                dict(
                    cp=cp,
                    comm=comm if cp > 1 else "-",
                    seq_len=seq_len,
                    step_s=float(elapsed),
                    saved_mib=float(stats[0]) / 2**20,
                    sent_mib=float(stats[1]) / 2**20,
                    analytic_mib=analytic_bytes(
                        comm, cp, layout.num_image_tokens, len(layout.texts[0]), flavor, 1
                    )
                    / 2**20,
                    balance=layout.balance(),
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="4096,8192,16384,32768")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--comms", default=",".join(CP_ATTENTION))
    parser.add_argument("--flavor", default="debug")
    opts = parser.parse_args()
    seq_lens = [int(x) for x in opts.seq_lens.split(",")]
    print(
        f"# {opts.flavor} flavor, batch 1, fp32, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}"
    )
    print(
        "| cp | comm | seq len | step s | saved MiB/rank | sent MiB/rank | analytic MiB | balance |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cp in (int(x) for x in opts.cps.split(",")):
        comms = opts.comms.split(",") if cp > 1 else ["p2p"]
        configs = [(comm, s) for s in seq_lens for comm in comms]
        for r in run_group(worker, cp, len(configs), configs, opts.flavor):
            print(
                f"| {r['cp']} | {r['comm']} | {r['seq_len']} | {r['step_s']:.2f} | "
                f"{r['saved_mib']:.1f} | "
                f"{r['sent_mib']:.2f} | {r['analytic_mib']:.2f} | {r['balance']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
