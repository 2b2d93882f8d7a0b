"""Attention kernels: block kernels (one dense or causal block per call) and varlen kernels
(a whole packed plan per call, varlen.py).

Block kernels: forward(q, k, v, causal, scale) -> (out, log-sum-exp, aux) on [B, H, L, D], and a
backward that takes the final (merged) out and lse. They run the ViT's attention (one dense block
per layer) and, on CPU and where no varlen kernel exists, each sequence of a packed plan
(`LoopVarlen`). Varlen kernels run a packed plan's call in one launch: on CUDA FlashAttention-2's
varlen kernel through aten (`CudaFlashVarlen`), with fewer K/V heads than query heads as they
come (no copies). Adding a kernel is adding a class to `KERNELS` (and, to make it the default
somewhere, a line to `select_kernel`); `model.attention_kernel` can force any of them.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_vlm.varlen import VarlenCall, VarlenKernel

aten = torch.ops.aten


class BlockKernel:
    """out, lse = forward(q, k, v, causal, scale); dq, dk, dv = backward(...).

    q [B, H, Lq, D], k/v [B, H, Lk, D] (heads already expanded); lse [B, H, Lq] float32, the
    natural-log sum of exp(scale * q.k) over the visible keys. `causal` is only used with
    Lq == Lk (a diagonal block). `aux` is whatever the kernel's backward needs from its forward.
    """

    name = "abstract"
    device_type = "abstract"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        aux: Any,
    ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class CpuFlash(BlockKernel):
    """aten's CPU flash attention (fp32/bf16), which returns the log-sum-exp."""

    name = "cpu_flash"
    device_type = "cpu"

    def forward(self, q, k, v, causal, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=None, scale=scale
        )


def _dense(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, H, L, D] views laid out in memory as [B, L, H, D], the layout the CUDA kernels produce
    and read (the efficient kernel's bf16 backward misreads `out` in any other layout)."""
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors)


class CudaFlash(BlockKernel):
    """FlashAttention-2 through aten (CUDA, fp16/bf16)."""

    name = "cuda_flash"
    device_type = "cuda"

    def forward(self, q, k, v, causal, scale):
        q, k, v = _dense(q, k, v)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dout, q, k, v, out = _dense(dout, q, k, v, out)
        return aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.contiguous(),
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )


class CudaEfficient(BlockKernel):
    """Memory-efficient attention through aten (CUDA, fp32/bf16/fp16). Its lse is padded along
    the query dim to a multiple of 32; we hand out the first Lq rows and pad back in backward."""

    name = "cuda_efficient"
    device_type = "cuda"

    def forward(self, q, k, v, causal, scale):
        q, k, v = _dense(q, k, v)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        seed, offset, lse_len = aux
        lse = torch.nn.functional.pad(lse, (0, lse_len - lse.shape[-1])).contiguous()
        dout, q, k, v, out = _dense(dout, q, k, v, out)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            k,
            v,
            None,
            out,
            lse,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, dk, dv


class CudaCudnn(BlockKernel):
    """cuDNN attention through aten (CUDA, fp16/bf16). Its lse keeps a trailing dim of 1."""

    name = "cuda_cudnn"
    device_type = "cuda"

    def forward(self, q, k, v, causal, scale):
        q, k, v = _dense(q, k, v)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )
        )
        return out, lse.reshape(q.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset, lse.shape)

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = aux
        dout, q, k, v, out = _dense(dout, q, k, v, out)
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.reshape(lse_shape).contiguous(),
            seed,
            offset,
            None,
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            scale=scale,
        )


# ----------------------------------------------------------------------------------------------
# Varlen kernels


def expand_kv_heads(x: torch.Tensor, n_heads: int, dim: int = 1) -> torch.Tensor:
    """Grouped-query attention: repeat each K/V head (along `dim`) for its query heads."""
    n_kv = x.shape[dim]
    return x if n_kv == n_heads else x.repeat_interleave(n_heads // n_kv, dim=dim)


def reduce_kv_heads(grad: torch.Tensor, n_kv: int, dim: int = 1) -> torch.Tensor:
    """Backward of `expand_kv_heads`: sum the gradients of the query heads sharing a K/V head."""
    h = grad.shape[dim]
    if h == n_kv:
        return grad
    return grad.unflatten(dim, (n_kv, h // n_kv)).sum(dim + 1)


def _bhld(x: torch.Tensor) -> torch.Tensor:
    """A packed sequence [L, H, D] as a block kernel's [1, H, L, D]."""
    return x.transpose(0, 1).unsqueeze(0)


class LoopVarlen(VarlenKernel):
    """The reference varlen executor: a loop over the sequences calling a block kernel (aten's
    CPU flash on CPU). A causal sequence with Lk > Lq is a dense block over its first Lk - Lq keys
    and a causal diagonal over the rest, merged by log-sum-exp (two launches). K/V heads are
    expanded for the block kernel."""

    def __init__(self, block: BlockKernel):
        self.block = block
        self.name = block.name

    def _parts(self, lq: int, lk: int, causal: bool) -> list[tuple[slice, bool]]:
        if not causal:
            return [(slice(0, lk), False)]
        if lk == lq:
            return [(slice(0, lk), True)]
        return [(slice(0, lk - lq), False), (slice(lk - lq, lk), True)]

    def launches(self, call: VarlenCall) -> int:
        return sum(len(self._parts(lq, lk, call.causal)) for lq, lk in call.lengths())

    def forward(self, q, k, v, call, scale):
        h = q.shape[1]
        out = torch.empty_like(q)
        lse = q.new_empty(h, q.shape[0], dtype=torch.float32)
        auxes = []
        cq, ck = call.cu_q.tolist(), call.cu_k.tolist()
        for i in range(len(cq) - 1):
            qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            qi = _bhld(q[qs])
            ki, vi = (_bhld(expand_kv_heads(x[ks], h)) for x in (k, v))
            acc_out, acc_lse, seq_aux = None, None, []
            for part, causal in self._parts(qs.stop - qs.start, ks.stop - ks.start, call.causal):
                o, part_lse, aux = self.block.forward(
                    qi, ki[:, :, part], vi[:, :, part], causal, scale
                )
                seq_aux.append(aux)
                if acc_out is None:
                    acc_out, acc_lse = o.float(), part_lse
                else:
                    new = torch.logaddexp(acc_lse, part_lse)
                    acc_out = acc_out * torch.exp(acc_lse - new).unsqueeze(-1) + o.float() * (
                        torch.exp(part_lse - new).unsqueeze(-1)
                    )
                    acc_lse = new
            out[qs] = acc_out[0].transpose(0, 1).to(q.dtype)
            lse[:, qs] = acc_lse[0]
            auxes.append(seq_aux)
        return out, lse, auxes

    def backward(self, dout, q, k, v, out, lse, call, scale, aux):
        h, n_kv = q.shape[1], k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        cq, ck = call.cu_q.tolist(), call.cu_k.tolist()
        for i in range(len(cq) - 1):
            qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            qi, oi, doi = _bhld(q[qs]), _bhld(out[qs]), _bhld(dout[qs])
            li = lse[None, :, qs]
            ki, vi = (_bhld(expand_kv_heads(x[ks], h)) for x in (k, v))
            dqi = torch.zeros_like(qi, dtype=torch.float32)
            dki, dvi = torch.empty_like(ki), torch.empty_like(vi)
            parts = self._parts(qs.stop - qs.start, ks.stop - ks.start, call.causal)
            for (part, causal), a in zip(parts, aux[i]):
                g = self.block.backward(
                    doi, qi, ki[:, :, part], vi[:, :, part], oi, li, causal, scale, a
                )
                dqi += g[0].float()
                dki[:, :, part], dvi[:, :, part] = g[1], g[2]
            dq[qs] = dqi[0].transpose(0, 1).to(q.dtype)
            dk[ks] = reduce_kv_heads(dki[0].transpose(0, 1), n_kv)
            dv[ks] = reduce_kv_heads(dvi[0].transpose(0, 1), n_kv)
        return dq, dk, dv


class CudaFlashVarlen(VarlenKernel):
    """FlashAttention-2's varlen kernel through aten (CUDA, fp16/bf16): one launch per call, K/V
    with their own (fewer) heads, bottom-right causal alignment, lse [H, Tq]."""

    name = "cuda_flash"

    def launches(self, call: VarlenCall) -> int:
        return 1

    def forward(self, q, k, v, call, scale):
        out, lse, rng_state, unused, _ = aten._flash_attention_forward(
            q,
            k,
            v,
            call.cu_q,
            call.cu_k,
            call.max_q,
            call.max_k,
            0.0,
            call.causal,
            False,
            scale=scale,
        )
        return out, lse, (rng_state, unused)

    def backward(self, dout, q, k, v, out, lse, call, scale, aux):
        rng_state, unused = aux
        return aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            call.cu_q,
            call.cu_k,
            call.max_q,
            call.max_k,
            0.0,
            call.causal,
            rng_state,
            unused,
            scale=scale,
        )


KERNELS: dict[str, BlockKernel] = {
    k.name: k for k in (CpuFlash(), CudaFlash(), CudaEfficient(), CudaCudnn())
}
VARLEN: dict[str, VarlenKernel] = {
    "cpu_flash": LoopVarlen(KERNELS["cpu_flash"]),
    "cuda_flash": CudaFlashVarlen(),
    "cuda_efficient": LoopVarlen(KERNELS["cuda_efficient"]),
    "cuda_cudnn": LoopVarlen(KERNELS["cuda_cudnn"]),
}
_forced: BlockKernel | None = None


def use_kernel(name: str) -> None:
    """model.attention_kernel: "auto" chooses per device and dtype; a kernel name forces it."""
    global _forced
    _forced = None if name == "auto" else KERNELS[name]


def select_kernel(device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The block kernel for a device and dtype, or the one `use_kernel` forced. CPU: CPU flash.
    CUDA: FlashAttention-2 for 16-bit, memory-efficient for fp32 (the only one that takes fp32).
    cuDNN is faster on Hopper (docs/performance.md) but opt-in (model.attention_kernel =
    "cuda_cudnn"): it is checked at the kernel level only, not yet in a full training run."""
    if _forced is not None:
        if _forced.device_type != device.type:
            raise RuntimeError(
                f"model.attention_kernel={_forced.name} runs on {_forced.device_type}, "
                f"the tensors are on {device.type}"
            )
        return _forced
    if device.type == "cpu":
        return KERNELS["cpu_flash"]
    if device.type == "cuda":
        return KERNELS[
            "cuda_flash" if dtype in (torch.float16, torch.bfloat16) else "cuda_efficient"
        ]
    raise RuntimeError(f"no attention kernel for device type {device.type!r}")


def select_varlen(device: torch.device, dtype: torch.dtype) -> VarlenKernel:
    """The varlen kernel of the block kernel `select_kernel` picks: FlashAttention-2's varlen
    kernel for cuda_flash, else the loop over sequences with that block kernel."""
    return VARLEN[select_kernel(device, dtype).name]
