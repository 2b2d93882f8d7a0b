"""A mixture-of-experts layer on this machine:

    python benchmarks/moe_layer.py [--tokens 4096,16384] [--dim 512] [--ffn 256] [--experts 8]

1. The experts' matmuls, one process: titan_vlm's op (models/common/grouped.py: one matmul per
   expert on its rows, forward + backward) against torch._grouped_mm (one call over all experts;
   forward only: its CPU backward fails on torch 2.13, "Invalid strides/sizes"), on the same
   routed rows. Rows of tokens x top_k, routed by a random router.
2. The whole layer (router, experts, combine; forward + backward) at ep = 1 and ep = 2 on 2 gloo
   processes, each with its own tokens: step time (slowest rank) and the bytes each rank sends
   by all-to-all per step, counted by wrapping torch.distributed.all_to_all_single, beside the
   planner's figure (titan_vlm/plan/comm.py ep_layer_bytes: a router that spreads the picks
   evenly, 4 x tokens x top_k x (ep - 1) / ep rows of dim, out and back in the forward and in
   the backward, plus the forward's rows per expert).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _group import run_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_vlm.models.common.grouped import experts
from titan_vlm.models.common.moe import MoE
from titan_vlm.models.common.text_args import MoEArgs
from titan_vlm.plan.comm import ep_layer_bytes

TOP_K = 2


def routed(tokens: int, dim: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens x TOP_K rows grouped by expert, and the rows per expert, from a random router."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g)
    picks = torch.randn(tokens, num_experts, generator=g).topk(TOP_K, dim=-1).indices.flatten()
    order = picks.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long).index_add(0, picks, torch.ones_like(picks))
    return x[order // TOP_K], counts


def timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def loop_forward(x, counts, w1, w3, w2) -> torch.Tensor:
    return experts(x, counts, w1, w3, w2)


def loop_forward_backward(x, counts, w1, w3, w2) -> None:
    ws = [w.clone().requires_grad_() for w in (w1, w3, w2)]
    experts(x.clone().requires_grad_(), counts, *ws).sum().backward()


def grouped_forward(x, counts, w1, w3, w2) -> torch.Tensor:
    offs = counts.cumsum(0).to(torch.int32)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


def grouped_table(token_counts: list[int], dim: int, ffn: int, num_experts: int) -> None:
    print("| tokens | rows | loop fwd s | loop fwd+bwd s | _grouped_mm fwd s | max diff |")
    print("|---|---|---|---|---|---|")
    for tokens in token_counts:
        x, counts = routed(tokens, dim, num_experts)
        w1, w3 = (torch.randn(num_experts, ffn, dim) * dim**-0.5 for _ in range(2))
        w2 = torch.randn(num_experts, dim, ffn) * ffn**-0.5
        case = (x, counts, w1, w3, w2)
        diff = float((loop_forward(*case) - grouped_forward(*case)).abs().max())
        times = [timed(partial(f, *case)) for f in (loop_forward, loop_forward_backward)]
        print(
            f"| {tokens} | {x.shape[0]} | {times[0]:.4f} | {times[1]:.4f} | "
            f"{timed(partial(grouped_forward, *case)):.4f} | {diff:.1e} |"
        )


def layer_step(layer: MoE, x: torch.Tensor, weights: torch.Tensor) -> None:
    out, _ = layer(x, weights)
    out.sum().backward()


@contextmanager
def count_all_to_all() -> Iterator[dict]:
    """Bytes this rank sends by all_to_all_single (not what it keeps for itself)."""
    sent = {"bytes": 0}
    original = dist.all_to_all_single

    def wrapped(out, x, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        rank = dist.get_rank(group)
        if input_split_sizes is None:
            kept = x.nbytes // dist.get_world_size(group)
        else:
            kept = input_split_sizes[rank] * x[:1].nbytes
        sent["bytes"] += x.nbytes - kept
        return original(out, x, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.all_to_all_single = wrapped
    try:
        yield sent
    finally:
        dist.all_to_all_single = original


def ep_worker(rank: int, size: int, results, token_counts: list[int], dim: int, ffn: int, e: int):
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))
    for ep in (1, size):
        torch.manual_seed(0)
        layer = MoE(dim, MoEArgs(num_experts=e, top_k=TOP_K, ffn_dim=ffn))
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=dim**-0.5)
        if ep > 1:
            for name, p in list(layer.experts.named_parameters()):
                sharded = torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]))
                layer.experts.register_parameter(name, sharded)
            layer.experts.ep_group = str(mesh.get_group().group_name)
        for tokens in token_counts:
            g = torch.Generator().manual_seed(rank)  # each rank its own tokens
            x = torch.randn(1, tokens, dim, generator=g, requires_grad=True)
            step = partial(layer_step, layer, x, torch.ones(1, tokens))
            step()  # warm-up
            with count_all_to_all() as sent:
                dist.barrier()
                start = time.perf_counter()
                step()
                took = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            planned = ep_layer_bytes(tokens * TOP_K, dim, 4, ep, e)
            if rank == 0:
                results.put(
                    dict(
                        ep=ep,
                        tokens=tokens,
                        step_s=float(took),
                        sent_mib=sent["bytes"] / 2**20,
                        planned_mib=planned / 2**20,
                    )
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    opts = parser.parse_args()
    token_counts = [int(t) for t in opts.tokens.split(",")]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; dim {opts.dim}, "
        f"ffn {opts.ffn}, {opts.experts} experts, top {TOP_K}, fp32\n"
    )
    grouped_table(token_counts, opts.dim, opts.ffn, opts.experts)
    print("\n| ep | tokens per rank | layer fwd+bwd s | all-to-all sent MiB | planner MiB |")
    print("|---|---|---|---|---|")
    args = (token_counts, opts.dim, opts.ffn, opts.experts)
    for r in run_group(ep_worker, 2, 2 * len(token_counts), *args):
        print(
            f"| {r['ep']} | {r['tokens']} | {r['step_s']:.4f} | {r['sent_mib']:.2f} | "
            f"{r['planned_mib']:.2f} |"
        )


if __name__ == "__main__":
    main()
