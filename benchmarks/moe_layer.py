"""A mixture-of-experts layer on this machine:

    python benchmarks/moe_layer.py [--tokens 4096,16384] [--dim 512] [--ffn 256] [--experts 8]
    python benchmarks/moe_layer.py --kernels-only --device cuda --dtype bfloat16 \
        --tokens 4096,16384 --dim 2048 --ffn 768 --experts 128 --top-k 8   # a GPU, 30B-A3B shapes

1. The experts' matmuls, one process: titan_vlm's op with its two kernels
   (models/common/grouped.py KERNELS, model.experts_kernel: "loop", one matmul per expert on
   its rows, and "grouped_mm", torch._grouped_mm, one call over all the experts per
   projection), forward and forward + backward, on the same routed rows, and each kernel's
   largest error (the output's and the gradients', relative to their largest entry) against an
   fp32 loop on the same inputs (in fp32: the two kernels' difference). Rows of tokens x
   top_k, routed by a random router; the "skewed" rows send every pick to a quarter of the
   experts, so most experts get no rows (the grouped kernel's empty groups).
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
from _group import run_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_vlm.models.common.grouped import experts
from titan_vlm.models.common.moe import MoE
from titan_vlm.models.common.text_args import MoEArgs
from titan_vlm.plan.comm import ep_layer_bytes

TOP_K = 2  # the EP table's


def routed(
    tokens: int, dim: int, num_experts: int, top_k: int, used: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens x top_k rows grouped by expert, and the rows per expert, from a random router
    that picks among the first `used` experts."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g)
    picks = torch.randn(tokens, used, generator=g).topk(top_k, dim=-1).indices.flatten()
    order = picks.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long).index_add(0, picks, torch.ones_like(picks))
    return x[order // top_k].to(device, dtype), counts.to(device)


def timed(fn, device: str, repeats: int = 3) -> float:
    fn()  # warm-up
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def forward(kernel: str, x, counts, w1, w3, w2) -> torch.Tensor:
    return experts(x, counts, w1, w3, w2, kernel)


def forward_backward(kernel: str, x, counts, w1, w3, w2) -> list[torch.Tensor]:
    xs, ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in (w1, w3, w2)]
    experts(xs, counts, *ws, kernel).float().square().sum().backward()
    return [xs.grad, *(w.grad for w in ws)]


def kernel_table(
    token_counts: list[int],
    dim: int,
    ffn: int,
    num_experts: int,
    top_k: int,
    device: str,
    dtype: torch.dtype,
) -> None:
    print(
        "| tokens | routing | rows | loop fwd s | loop fwd+bwd s | grouped_mm fwd s | "
        "grouped_mm fwd+bwd s | max rel err loop | max rel err grouped_mm |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    cases = [(t, "random", num_experts) for t in token_counts]
    cases.append((token_counts[0], "skewed", max(top_k, num_experts // 4)))
    for tokens, routing, used in cases:
        x, counts = routed(tokens, dim, num_experts, top_k, used, device, dtype)
        g = torch.Generator().manual_seed(1)
        w1, w3 = (torch.randn(num_experts, ffn, dim, generator=g) * dim**-0.5 for _ in range(2))
        w2 = torch.randn(num_experts, dim, ffn, generator=g) * ffn**-0.5
        case = (x, counts, *(w.to(device, dtype) for w in (w1, w3, w2)))
        # the reference: the loop in fp32 on the same (rounded) inputs; in fp32, the loop itself
        ref_case = (x.float(), counts, *(w.to(device, dtype).float() for w in (w1, w3, w2)))
        ref = [forward("loop", *ref_case), *forward_backward("loop", *ref_case)]
        errs = []
        for kernel in ("loop", "grouped_mm"):
            got = [forward(kernel, *case), *forward_backward(kernel, *case)]
            errs.append(
                max(
                    float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30))
                    for a, b in zip(got, ref)
                )
            )
        times = [
            timed(partial(f, k, *case), device)
            for k in ("loop", "grouped_mm")
            for f in (forward, forward_backward)
        ]
        print(
            f"| {tokens} | {routing} | {x.shape[0]} | {times[0]:.4f} | {times[1]:.4f} | "
            f"{times[2]:.4f} | {times[3]:.4f} | {errs[0]:.1e} | {errs[1]:.1e} |",
            flush=True,
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
    parser.add_argument("--top-k", type=int, default=TOP_K, help="the kernel table's")
    parser.add_argument("--device", default="cpu", help="the kernel table's device (cuda: a GPU)")
    parser.add_argument("--dtype", default="float32", help="the kernel table's (bfloat16, ...)")
    parser.add_argument(
        "--kernels-only", action="store_true", help="the kernel table alone (no gloo processes)"
    )
    opts = parser.parse_args()
    dtype = getattr(torch, opts.dtype)
    token_counts = [int(t) for t in opts.tokens.split(",")]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; dim {opts.dim}, "
        f"ffn {opts.ffn}, {opts.experts} experts; kernels top {opts.top_k} on {opts.device} in "
        f"{opts.dtype}, the layer top {TOP_K} on the CPU in fp32\n"
    )
    kernel_table(token_counts, opts.dim, opts.ffn, opts.experts, opts.top_k, opts.device, dtype)
    if opts.kernels_only:
        return
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
