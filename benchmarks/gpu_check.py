"""GPU checks of titan_vlm's attention kernels: python benchmarks/gpu_check.py (needs CUDA).

1. Every CUDA block kernel (flash for bf16, memory-efficient for fp32 and bf16) used exactly as
   the ring attention uses it: the head-tail ring schedule of P virtual ranks is replayed in one
   process (blocks, log-sum-exp merges, and the backward of every block with the merged out and
   lse), and the output and dQ/dK/dV are compared with a float64 reference of the whole row.
2. The block kernel's own speed: causal forward + backward at long lengths, in TFLOP/s.

The multi-rank runs (NCCL, several GPUs) are not here: this machine has one GPU.
"""

from __future__ import annotations

import time

import torch

from titan_vlm.attention import KERNELS, merge_into
from titan_vlm.parallel.context_parallel import head_tail_indices
from titan_vlm.attention import Blocks
from titan_vlm.parallel.cp_attention import _accumulators, _ring_block


def reference(q, k, v, n):
    """float64 causal attention of the whole row (image prefix first, then text), with grads."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    h = q.shape[1]
    ke, ve = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    return out, (q, k, v)


def simulate_ring(q, k, v, n, p, kernel):
    """Replay the ring schedule of p ranks on one device. q/k/v hold the whole row in row order."""
    c = (q.shape[2] - n) // (2 * p)
    idx = [torch.cat([torch.arange(n), n + head_tail_indices(2 * p * c, p, r)]).to(q.device) for r in range(p)]
    local = [(q[:, :, i], k[:, :, i], v[:, :, i]) for i in idx]
    blocks = Blocks(q)
    blocks.kernel = kernel
    outs, lses, auxes = [], [], []
    for r, (ql, kl, vl) in enumerate(local):
        out, lse = _accumulators(ql)
        aux_r = []
        for rows, causal in ((slice(0, n), True), (slice(n, None), False)):
            o, l, a = blocks.forward(ql[:, :, rows], kl[:, :, :n], vl[:, :, :n], causal)
            merge_into(out[:, :, rows], lse[:, :, rows], o, l)
            aux_r.append(a)
        for step in range(p):
            src = (r - step) % p
            rows, keys, causal = _ring_block(step, src, r, c)
            kt, vt = local[src][1][:, :, n:], local[src][2][:, :, n:]
            o, l, a = blocks.forward(ql[:, :, n:][:, :, rows], kt[:, :, keys], vt[:, :, keys], causal)
            merge_into(out[:, :, n:][:, :, rows], lse[:, :, n:][:, :, rows], o, l)
            aux_r.append(a)
        outs.append(out.to(q.dtype))
        lses.append(lse)
        auxes.append(aux_r)
    # backward with dout = 1 / numel on every output element (the image rows once: rank 0's)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    for r, (ql, kl, vl) in enumerate(local):
        dout = torch.ones_like(outs[r])
        if r > 0:
            dout[:, :, :n] = 0  # image rows are replicated: count their loss once
        out, lse, i = outs[r], lses[r], idx[r]
        grads = []
        for (rows, causal), a in zip(((slice(0, n), True), (slice(n, None), False)), auxes[r][:2]):
            dq_, dk_, dv_ = blocks.backward(dout[:, :, rows].contiguous(), ql[:, :, rows], kl[:, :, :n], vl[:, :, :n],
                                            out[:, :, rows], lse[:, :, rows], causal, a)
            grads.append((i[rows], dq_, i[:n], dk_, dv_))
        for step in range(p):
            src = (r - step) % p
            rows, keys, causal = _ring_block(step, src, r, c)
            kt, vt = local[src][1][:, :, n:], local[src][2][:, :, n:]
            dq_, dk_, dv_ = blocks.backward(dout[:, :, n:][:, :, rows].contiguous(), ql[:, :, n:][:, :, rows],
                                            kt[:, :, keys], vt[:, :, keys], out[:, :, n:][:, :, rows],
                                            lse[:, :, n:][:, :, rows], causal, auxes[r][2 + step])
            grads.append((i[n:][rows], dq_, idx[src][n:][keys], dk_, dv_))
        for qi, dq_, ki, dk_, dv_ in grads:
            dq[:, :, qi] += dq_.float()
            dk[:, :, ki] += dk_.float()
            dv[:, :, ki] += dv_.float()
    out_row = torch.empty_like(q)
    for r in range(p):
        out_row[:, :, idx[r]] = outs[r]
    return out_row, dq, dk, dv


def rel(a, b):
    return float((a.detach().double() - b.double()).norm() / b.double().norm())


def check_kernel(name: str, dtype: torch.dtype) -> None:
    if True:
        for p in (2, 4):
            torch.manual_seed(0)
            n, text = 64, 1024
            q = torch.randn(2, 8, n + text, 64, device="cuda", dtype=dtype)
            k = torch.randn(2, 2, n + text, 64, device="cuda", dtype=dtype)
            v = torch.randn(2, 2, n + text, 64, device="cuda", dtype=dtype)
            out, dq, dk, dv = simulate_ring(q, k, v, n, p, KERNELS[name])
            ref, (rq, rk, rv) = reference(q, k, v, n)
            ref.sum().backward()
            print(f"| {name} | {str(dtype).split('.')[1]} | {p} | {rel(out, ref):.1e} | {rel(dq, rq.grad):.1e} | "
                  f"{rel(dk, rk.grad):.1e} | {rel(dv, rv.grad):.1e} |", flush=True)


def kernel_speed() -> None:
    print("\n## block kernel, causal forward + backward (B=1, H=32, D=128)")
    print("| kernel | dtype | L | ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    for name, dtype in (("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.bfloat16),
                        ("cuda_efficient", torch.float32), ("cuda_cudnn", torch.bfloat16)):
        kernel = KERNELS[name]
        for length in (8192, 32768):
            q, k, v = (torch.randn(1, 32, length, 128, device="cuda", dtype=dtype) for _ in range(3))
            scale = 128 ** -0.5
            for i in range(4):
                if i == 1:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                out, lse, aux = kernel.forward(q, k, v, True, scale)
                kernel.backward(torch.ones_like(out), q, k, v, out, lse, True, scale, aux)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / 3 * 1e3
            flops = 3.5 * 2 * 2 * 32 * length * length * 128 / 2  # fwd 2 matmuls + bwd 5, causal half
            print(f"| {name} | {str(dtype).split('.')[1]} | {length} | {ms:.1f} | {flops / ms / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3:  # one kernel check per process: a kernel fault cannot spoil the others
        check_kernel(sys.argv[1], getattr(torch, sys.argv[2]))
        sys.exit()
    import subprocess

    print(torch.__version__, torch.cuda.get_device_name())
    print("## ring schedule on CUDA kernels vs float64 reference (B=2, H=8, Hkv=2, D=64, 64 image + 1024 text)")
    print("| kernel | dtype | P | out | dQ | dK | dV |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name, dtype in (("cuda_flash", "bfloat16"), ("cuda_efficient", "float32"), ("cuda_efficient", "bfloat16"),
                        ("cuda_cudnn", "bfloat16")):
        done = subprocess.run([sys.executable, __file__, name, dtype], capture_output=True, text=True)
        print(done.stdout, end="" if done.returncode == 0 else f"| {name} | {dtype} | failed: "
              f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode} |\n", flush=True)
    kernel_speed()
