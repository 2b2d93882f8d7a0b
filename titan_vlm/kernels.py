"""Attention kernels: one interface (varlen.VarlenKernel), one registry (`KERNELS`), and the
choice of a kernel for a device and dtype (`select_kernel`).

Every kernel runs a packed plan's `VarlenCall` (varlen.py) and, for the ViT, one batch of dense
blocks (`dense`: every query of an image sees every key of it). Every kernel is built on one
batched block op, `block` / `block_backward` on [B, H, L, D]: a call is a loop over its
sequences, each one block (two for a causal sequence with more keys than queries), merged by
log-sum-exp, and the ViT's batch is one block over all its images (one launch). FlashAttention-2
(`CudaFlash`) also runs a whole call in one varlen launch, with fewer K/V heads than query heads
as they come (no copies).

The choice is a value, not state: the model holds `model.attention_kernel` (VLMArgs, from the
config) and passes the name to every attention call, and `select_kernel(name, device, dtype)`
resolves it there ("auto": per device and dtype). Adding a kernel is adding a class to `KERNELS`
(and, to make it the default somewhere, a line to `select_kernel`); the config accepts
`KERNEL_NAMES`.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_vlm.errors import ConfigError
from titan_vlm.varlen import VarlenCall, VarlenKernel, merge

aten = torch.ops.aten


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
    """A packed sequence [L, H, D] as a block op's [1, H, L, D]."""
    return x.transpose(0, 1).unsqueeze(0)


def _parts(lq: int, lk: int, causal: bool) -> list[tuple[slice, bool]]:
    """The blocks of one sequence: its key range and causality. A causal sequence with Lk > Lq
    is bottom-right aligned: a dense block over its first Lk - Lq keys, a diagonal over the rest
    (the block ops' causal mask is only used with Lq == Lk)."""
    if not causal:
        return [(slice(0, lk), False)]
    if lk == lq:
        return [(slice(0, lk), True)]
    return [(slice(0, lk - lq), False), (slice(lk - lq, lk), True)]


class Kernel(VarlenKernel):
    """An attention kernel: `forward`/`backward`/`launches` run a varlen call (the interface,
    varlen.VarlenKernel), `dense`/`dense_backward` a batch of dense blocks, and a subclass gives
    the batched block op both are made of:

        out, lse, aux = block(q, k, v, causal, scale)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal, scale, aux)

    q [B, H, Lq, D], k/v [B, H, Lk, D] (K/V heads expanded); lse [B, H, Lq] float32, the
    natural-log sum of exp(scale * q.k) over the visible keys; `causal` only with Lq == Lk.
    `aux` is whatever the op's backward needs from its forward. The block backward takes the
    final (merged) out and lse. `device_type`: where the kernel runs ("cpu" or "cuda")."""

    device_type = "abstract"

    def block(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def block_backward(
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

    def dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Every query sees every key of its batch row, all rows in one launch (the ViT's
        attention): q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> out [B, H, Lq, D], lse [B, H, Lq]."""
        h = q.shape[1]
        return self.block(q, expand_kv_heads(k, h), expand_kv_heads(v, h), False, scale)

    def dense_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Backward of `dense`: dk/dv with k's (fewer) heads."""
        h, n_kv = q.shape[1], k.shape[1]
        ke, ve = expand_kv_heads(k, h), expand_kv_heads(v, h)
        dq, dk, dv = self.block_backward(dout, q, ke, ve, out, lse, False, scale, aux)[:3]
        return dq, reduce_kv_heads(dk, n_kv), reduce_kv_heads(dv, n_kv)

    def launches(self, call: VarlenCall) -> int:
        """The loop's launches: one per block of every sequence."""
        return sum(len(_parts(lq, lk, call.causal)) for lq, lk in call.lengths())

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: VarlenCall, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The reference executor: a loop over the call's sequences, K/V heads expanded for the
        block op, the blocks of a sequence merged by log-sum-exp."""
        h = q.shape[1]
        out = torch.empty_like(q)
        lse = q.new_empty(h, q.shape[0], dtype=torch.float32)
        auxes = []
        for qs, ks in call.sequences():
            qi = _bhld(q[qs])
            ki, vi = (_bhld(expand_kv_heads(x[ks], h)) for x in (k, v))
            acc_out: torch.Tensor | None = None
            acc_lse = lse  # replaced by the first block's
            seq_aux = []
            for part, causal in _parts(qs.stop - qs.start, ks.stop - ks.start, call.causal):
                o, part_lse, aux = self.block(qi, ki[:, :, part], vi[:, :, part], causal, scale)
                seq_aux.append(aux)
                if acc_out is None:
                    acc_out, acc_lse = o.float(), part_lse
                else:
                    acc_out, acc_lse = merge(acc_out, acc_lse, o, part_lse)
            assert acc_out is not None  # every sequence has at least one block
            out[qs] = acc_out[0].transpose(0, 1).to(q.dtype)
            lse[:, qs] = acc_lse[0]
            auxes.append(seq_aux)
        return out, lse, auxes

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        call: VarlenCall,
        scale: float,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, n_kv = q.shape[1], k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for (qs, ks), seq_aux in zip(call.sequences(), aux):
            qi, oi, doi = _bhld(q[qs]), _bhld(out[qs]), _bhld(dout[qs])
            li = lse[None, :, qs]
            ki, vi = (_bhld(expand_kv_heads(x[ks], h)) for x in (k, v))
            dqi = torch.zeros_like(qi, dtype=torch.float32)
            dki, dvi = torch.empty_like(ki), torch.empty_like(vi)
            parts = _parts(qs.stop - qs.start, ks.stop - ks.start, call.causal)
            for (part, causal), a in zip(parts, seq_aux):
                g = self.block_backward(
                    doi, qi, ki[:, :, part], vi[:, :, part], oi, li, causal, scale, a
                )
                dqi += g[0].float()
                dki[:, :, part], dvi[:, :, part] = g[1], g[2]
            dq[qs] = dqi[0].transpose(0, 1).to(q.dtype)
            dk[ks] = reduce_kv_heads(dki[0].transpose(0, 1), n_kv)
            dv[ks] = reduce_kv_heads(dvi[0].transpose(0, 1), n_kv)
        return dq, dk, dv


class CpuFlash(Kernel):
    """aten's CPU flash attention (fp32/bf16), which returns the log-sum-exp."""

    name = "cpu_flash"
    device_type = "cpu"

    def block(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
        return out, lse, None

    def block_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        aux: None,
    ) -> tuple[torch.Tensor, ...]:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=None, scale=scale
        )


def _dense_layout(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, H, L, D] views laid out in memory as [B, L, H, D], the layout the CUDA kernels produce
    and read (the efficient kernel's bf16 backward misreads `out` in any other layout)."""
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors)


class CudaFlash(Kernel):
    """FlashAttention-2 through aten (CUDA, fp16/bf16): a dense batch as one batched launch, a
    varlen call as one varlen launch (K/V with their own, fewer, heads; bottom-right causal
    alignment; lse [H, Tq])."""

    name = "cuda_flash"
    device_type = "cuda"

    def block(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        q, k, v = _dense_layout(q, k, v)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def block_backward(
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
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dout, q, k, v, out = _dense_layout(dout, q, k, v, out)
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

    def launches(self, call: VarlenCall) -> int:
        return 1

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: VarlenCall, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
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

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        call: VarlenCall,
        scale: float,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


class CudaEfficient(Kernel):
    """Memory-efficient attention through aten (CUDA, fp32/bf16/fp16). Its lse is padded along
    the query dim to a multiple of 32; we hand out the first Lq rows and pad back in backward."""

    name = "cuda_efficient"
    device_type = "cuda"

    def block(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        q, k, v = _dense_layout(q, k, v)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])

    def block_backward(
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
        seed, offset, lse_len = aux
        lse = torch.nn.functional.pad(lse, (0, lse_len - lse.shape[-1])).contiguous()
        dout, q, k, v, out = _dense_layout(dout, q, k, v, out)
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


class CudaCudnn(Kernel):
    """cuDNN attention through aten (CUDA, fp16/bf16). Its lse keeps a trailing dim of 1."""

    name = "cuda_cudnn"
    device_type = "cuda"

    def block(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        q, k, v = _dense_layout(q, k, v)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )
        )
        return out, lse.reshape(q.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset, lse.shape)

    def block_backward(
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
        cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = aux
        dout, q, k, v, out = _dense_layout(dout, q, k, v, out)
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


KERNELS: dict[str, Kernel] = {
    k.name: k for k in (CpuFlash(), CudaFlash(), CudaEfficient(), CudaCudnn())
}
# model.attention_kernel: "auto" (chosen per device and dtype) or a kernel forced by name
KERNEL_NAMES: tuple[str, ...] = ("auto", *KERNELS)


def select_kernel(name: str, device: torch.device, dtype: torch.dtype) -> Kernel:
    """The kernel `name` (model.attention_kernel) means for tensors on `device` in `dtype`.
    "auto": CPU flash on CPU; on CUDA FlashAttention-2 for 16-bit, memory-efficient for fp32
    (the only one that takes fp32). cuDNN's block kernel is faster on Hopper at long lengths
    but opt-in (model.attention_kernel = "cuda_cudnn"): in a training step it trains the same
    but 6x slower at the debug shapes, since a packed plan calls it once per sequence and it
    builds an execution plan per new length (docs/performance.md). A kernel forced for another
    device is an error."""
    if name != "auto":
        if name not in KERNELS:
            raise ConfigError(
                f"model.attention_kernel must be one of {', '.join(KERNEL_NAMES)}, got {name!r}"
            )
        kernel = KERNELS[name]
        if kernel.device_type != device.type:
            raise ConfigError(
                f"model.attention_kernel={name} runs on {kernel.device_type}, "
                f"the tensors are on {device.type}"
            )
        return kernel
    if device.type == "cpu":
        return KERNELS["cpu_flash"]
    if device.type == "cuda":
        return KERNELS[
            "cuda_flash" if dtype in (torch.float16, torch.bfloat16) else "cuda_efficient"
        ]
    raise ConfigError(f"model.attention_kernel=auto: no attention kernel for {device.type!r}")
