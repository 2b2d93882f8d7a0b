"""GPU checks of titan_vlm's attention kernels: python benchmarks/gpu_check.py (needs CUDA).

1. Every CUDA kernel used exactly as the ring attention uses it: FlashAttention-2's varlen
   kernel (cuda_flash, bf16, K/V heads not expanded), and the loop over sequences with the
   memory-efficient (fp32, bf16) and cuDNN block kernels. The packed plans of P virtual ranks
   on packed rows (several samples, an image mid-text) are replayed in one process (whole
   plans, log-sum-exp merges across ring steps, and the backward of every plan with the merged
   out and lse), and the output and dQ/dK/dV are compared with a float64 masked reference of
   the whole rows.
   `python benchmarks/gpu_check.py cpu_flash float32 cpu` runs the same check on a CPU.
2. The block kernel's own speed: causal forward + backward at long lengths, in TFLOP/s.

The multi-rank runs (NCCL, several GPUs) are not here: this machine has one GPU.
"""

from __future__ import annotations

import time

import torch

from titan_vlm.data.batch import Sample, collate
from titan_vlm.kernels import KERNELS
from titan_vlm.layout import Slots, build_layout, visible
from titan_vlm.varlen import merge, run_plan, run_plan_backward

TPI = 64  # image slots per image in this check


def packed_row(batch_rows: int = 2):
    """Rows of three samples: an image first, an image mid-text, text only (1,088 slots)."""
    image = torch.zeros(3, 8, 8)
    rows = [
        [
            Sample([image, list(range(300))]),
            Sample([list(range(50)), image, list(range(200))]),
            Sample([list(range(410))]),
        ]
    ] * batch_rows
    return collate(rows, 1088, TPI, 8, pad_id=0)


def reference(q, k, v, batch):
    """float64 attention of the whole rows under the mask rule, with grads."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    h = q.shape[1]
    ke, ve = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    row = Slots(batch.doc, torch.arange(batch.doc.shape[1]).expand_as(batch.doc), batch.image)
    mask = visible(row, row, False).to(q.device)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)
    return out.masked_fill((batch.doc < 0).to(q.device)[:, None, :, None], 0), (q, k, v)


def simulate_ring(q, k, v, batch, p, kernel):
    """Replay the ring of p ranks on one device, as RingAttention runs it: each rank's packed
    plans (the local plan, then every other rank's text) through the varlen `kernel`, log-sum-exp
    merges of the plans, and the backward of every plan with the merged out/lse. q/k/v hold the
    whole rows in row order."""
    layouts = [build_layout(batch.doc, batch.image, p, r)[1] for r in range(p)]
    idx = [
        torch.cat([lay.images.order, lay.texts[r].order], 1).to(q.device)
        for r, lay in enumerate(layouts)
    ]

    def take(x, i):  # [B, H, S, D] at local slots i [B, L]; padding slots read zeros
        got = x.gather(2, i.clamp(min=0)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
        return got.masked_fill((i < 0)[:, None, :, None], 0)

    local = [(take(q, i), take(k, i), take(v, i)) for i in idx]
    n = layouts[0].num_image_tokens
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    out_row = torch.zeros_like(q)
    for r, (ql, kl, vl) in enumerate(local):
        lay = layouts[r]
        # step 0: the local plan (images and own text); step s: rank r - s's text
        steps = [(lay.packed("local", "local"), kl, vl, idx[r])]
        steps += [
            (
                lay.packed("local", (r - s) % p),
                *(x[:, :, n:] for x in local[(r - s) % p][1:]),
                idx[(r - s) % p][:, n:],
            )
            for s in range(1, p)
        ]
        out, lse, auxes = None, None, []
        for plan, kk, vv, _ in steps:
            part_out, part_lse, aux = run_plan(kernel, ql, kk, vv, plan)
            auxes.append(aux)
            if out is None:
                out, lse = part_out.float(), part_lse
            else:
                out, lse = merge(out, lse, part_out, part_lse)
        out = out.to(q.dtype)
        # backward with dout = 1 on every real output slot
        # (the replicated image rows once: rank 0's)
        dout = torch.ones_like(out)
        if r > 0:
            dout[:, :, :n] = 0
        dql = torch.zeros_like(ql, dtype=torch.float32)
        for (plan, kk, vv, keys), aux in zip(steps, auxes):
            dkk, dvv = (
                torch.zeros_like(kk, dtype=torch.float32),
                torch.zeros_like(vv, dtype=torch.float32),
            )
            run_plan_backward(kernel, dout, ql, kk, vv, out, lse, plan, aux, dql, dkk, dvv)
            for grad, acc in ((dkk, dk), (dvv, dv)):
                scatter(acc, keys, grad)
        scatter(dq, idx[r], dql)
        mine = idx[r] if r == 0 else idx[r][:, n:]
        scatter(out_row, mine, out if r == 0 else out[:, :, n:])
    return out_row, dq, dk, dv


def scatter(acc, index, values):
    """acc[b, :, index[b, j]] += values[b, :, j] for the real (>= 0) slots."""
    keep = (index >= 0)[:, None, :, None].to(values.dtype)
    acc.scatter_add_(
        2,
        index.clamp(min=0)[:, None, :, None].expand(-1, acc.shape[1], -1, acc.shape[3]),
        (values * keep).to(acc.dtype),
    )


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def check_kernel(name: str, dtype: torch.dtype, device: str = "cuda") -> None:
    for p in (2, 4):
        torch.manual_seed(0)
        batch = packed_row()
        shape = (batch.num_rows, 8, batch.doc.shape[1], 64)
        q = torch.randn(shape, device=device, dtype=dtype)
        k = torch.randn(shape[0], 2, *shape[2:], device=device, dtype=dtype)
        v = torch.randn(shape[0], 2, *shape[2:], device=device, dtype=dtype)
        out, dq, dk, dv = simulate_ring(q, k, v, batch, p, KERNELS[name])
        ref, (rq, rk, rv) = reference(q, k, v, batch)
        ref.sum().backward()
        print(
            f"| {name} | {str(dtype).split('.')[1]} | {p} | {rel(out, ref):.1e} | "
            f"{rel(dq, rq.grad):.1e} | "
            f"{rel(dk, rk.grad):.1e} | {rel(dv, rv.grad):.1e} |",
            flush=True,
        )


def kernel_speed() -> None:
    print("\n## block kernel, causal forward + backward (B=1, H=32, D=128)")
    print("| kernel | dtype | L | ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    for name, dtype in (
        ("cuda_flash", torch.bfloat16),
        ("cuda_efficient", torch.bfloat16),
        ("cuda_efficient", torch.float32),
        ("cuda_cudnn", torch.bfloat16),
    ):
        kernel = KERNELS[name]
        for length in (8192, 32768):
            q, k, v = (
                torch.randn(1, 32, length, 128, device="cuda", dtype=dtype) for _ in range(3)
            )
            scale = 128**-0.5
            for i in range(4):
                if i == 1:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                out, lse, aux = kernel.block(q, k, v, True, scale)
                kernel.block_backward(torch.ones_like(out), q, k, v, out, lse, True, scale, aux)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / 3 * 1e3
            flops = (
                3.5 * 2 * 2 * 32 * length * length * 128 / 2
            )  # fwd 2 matmuls + bwd 5, causal half
            print(
                f"| {name} | {str(dtype).split('.')[1]} | {length} | {ms:.1f} | "
                f"{flops / ms / 1e9:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    import sys

    if len(sys.argv) >= 3:  # one kernel check per process: a kernel fault cannot spoil the others
        check_kernel(sys.argv[1], getattr(torch, sys.argv[2]), *sys.argv[3:])
        sys.exit()
    import subprocess

    print(torch.__version__, torch.cuda.get_device_name())
    print(
        "## ring schedule on CUDA kernels vs float64 reference "
        "(B=2, H=8, Hkv=2, D=64; packed rows of 3 "
        "samples, 2 images of 64 slots, one mid-text)"
    )
    print("| kernel | dtype | P | out | dQ | dK | dV |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name, dtype in (
        ("cuda_flash", "bfloat16"),
        ("cuda_efficient", "float32"),
        ("cuda_efficient", "bfloat16"),
        ("cuda_cudnn", "bfloat16"),
    ):
        done = subprocess.run(
            [sys.executable, __file__, name, dtype], capture_output=True, text=True
        )
        print(
            done.stdout,
            end=""
            if done.returncode == 0
            else f"| {name} | {dtype} | failed: "
            f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
            " |\n",
            flush=True,
        )
    kernel_speed()
