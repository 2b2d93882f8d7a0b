"""The one attention entry point of titan_vlm, and its pluggable block kernels.

Model code calls `attention(q, k, v, layout)` and knows nothing about parallelism. The
`SeqLayout` it passes along was built outside the model (by the data pipeline or by
`parallel/context_parallel.py`) and says where each local token sits in its row; when the row's
text is sharded over a context-parallel group, `layout.cp` carries the algorithm that makes the
attention exact across ranks (parallel/cp_attention.py).

Mask rule (decoder, layout.py): a query sees the keys of its own sample at earlier row
positions (and itself); the tokens of one image see each other causally or, with
model.image_attention = "bidirectional", all at once.

Every attention, local or context-parallel, is computed from blocks by one `BlockKernel`:
forward(q, k, v, causal) -> (out, log-sum-exp), and a backward that takes the final (merged)
out and lse. The layout turns the mask rule into a plan of dense blocks and causal diagonal
blocks (layout.plan), so no kernel needs an arbitrary mask. Adding a kernel is adding a class
to `KERNELS` (and, to make it the default somewhere, a line to `select_kernel`);
`model.attention_kernel` can force any of them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from titan_vlm.layout import Block, SeqLayout

aten = torch.ops.aten


class CPAttention(Protocol):
    """A context-parallel attention algorithm (see parallel/cp_attention.py)."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout
    ) -> torch.Tensor: ...


# ----------------------------------------------------------------------------------------------
# Block kernels


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


KERNELS: dict[str, BlockKernel] = {
    k.name: k for k in (CpuFlash(), CudaFlash(), CudaEfficient(), CudaCudnn())
}
_forced: BlockKernel | None = None


def use_kernel(name: str) -> None:
    """model.attention_kernel: "auto" chooses per device and dtype; a kernel name forces it."""
    global _forced
    _forced = None if name == "auto" else KERNELS[name]


def select_kernel(device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The kernel for a device and dtype, or the one `use_kernel` forced. CPU: CPU flash. CUDA:
    FlashAttention-2 for 16-bit, memory-efficient for fp32 (the only one that takes fp32). cuDNN
    is faster on Hopper (docs/performance.md) but opt-in (model.attention_kernel = "cuda_cudnn"):
    it is checked at the kernel level only, not yet in a full training run."""
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


# ----------------------------------------------------------------------------------------------
# Helpers shared by the local and the context-parallel attention


def expand_kv_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Grouped-query attention: repeat each K/V head for the query heads that share it."""
    n_kv = x.shape[1]
    return x if n_kv == n_heads else x.repeat_interleave(n_heads // n_kv, dim=1)


def reduce_kv_heads(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Backward of `expand_kv_heads`: sum the gradients of the query heads sharing a K/V head."""
    b, h, length, d = grad.shape
    return grad if h == n_kv else grad.view(b, n_kv, h // n_kv, length, d).sum(2)


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge one block's result into the float32 accumulators (in place), exactly:
    lse' = log(e^lse + e^lse_b); out' = e^(lse - lse') out + e^(lse_b - lse') out_b."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(
        block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1)
    )
    lse.copy_(new_lse)


class Blocks:
    """The kernel for q's device and dtype, with grouped-query heads handled: K/V come with their
    own (fewer) heads, are expanded for the kernel, and their gradients reduced back."""

    def __init__(self, q: torch.Tensor):
        self.kernel = select_kernel(q.device, q.dtype)
        self.scale = q.shape[-1] ** -0.5
        self.heads = q.shape[1]

    def forward(self, q, k, v, causal):
        h = self.heads
        return self.kernel.forward(
            q, expand_kv_heads(k, h), expand_kv_heads(v, h), causal, self.scale
        )

    def backward(self, dout, q, k, v, out, lse, causal, aux):
        n_kv, h = k.shape[1], self.heads
        dq, dk, dv = self.kernel.backward(
            dout, q, expand_kv_heads(k, h), expand_kv_heads(v, h), out, lse, causal, self.scale, aux
        )
        return dq, reduce_kv_heads(dk, n_kv), reduce_kv_heads(dv, n_kv)


def accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 output and lse accumulators for q's rows: nothing seen yet (out 0, lse -inf).
    Padding slots are in no block, so they keep out 0 (and are never backpropagated through)."""
    return torch.zeros_like(q, dtype=torch.float32), q.new_full(
        q.shape[:3], float("-inf"), dtype=torch.float32
    )


def blocks_forward(blocks: Blocks, q, k, v, plan: list[Block], out, lse) -> list:
    """Run the plan's blocks, merging into the out/lse accumulators; returns their auxes."""
    auxes = []
    for rows, qs, ks, causal in plan:
        o, block_lse, aux = blocks.forward(q[rows, :, qs], k[rows, :, ks], v[rows, :, ks], causal)
        merge_into(out[rows, :, qs], lse[rows, :, qs], o, block_lse)
        auxes.append(aux)
    return auxes


def blocks_backward(
    blocks: Blocks, dout, q, k, v, out, lse, plan: list[Block], auxes, dq, dk, dv
) -> None:
    """Backward of `blocks_forward` with the final out/lse, accumulating into dq/dk/dv."""
    for (rows, qs, ks, causal), aux in zip(plan, auxes):
        dq_, dk_, dv_ = blocks.backward(
            dout[rows, :, qs],
            q[rows, :, qs],
            k[rows, :, ks],
            v[rows, :, ks],
            out[rows, :, qs],
            lse[rows, :, qs],
            causal,
            aux,
        )
        dq[rows, :, qs] += dq_
        dk[rows, :, ks] += dk_
        dv[rows, :, ks] += dv_


class _PlannedAttention(torch.autograd.Function):
    """Attention as a list of dense and causal blocks (layout.plan), merged by log-sum-exp."""

    @staticmethod
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: list[Block]
    ) -> torch.Tensor:
        blocks = Blocks(q)
        out, lse = accumulators(q)
        auxes = blocks_forward(blocks, q, k, v, plan, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (blocks, plan, auxes)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        blocks, plan, auxes = ctx.meta
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        blocks_backward(blocks, dout.contiguous(), q, k, v, out, lse, plan, auxes, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def planned_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: list[Block]
) -> torch.Tensor:
    return _PlannedAttention.apply(q, k, v, plan)


class _BlockAttention(torch.autograd.Function):
    """One dense or causal block straight through the kernel (no accumulators to merge into)."""

    @staticmethod
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        blocks = Blocks(q)
        out, lse, aux = blocks.forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (blocks, causal, aux)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        blocks, causal, aux = ctx.meta
        return (*blocks.backward(dout.contiguous(), q, k, v, out, lse, causal, aux), None)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Attention of one block: every query sees every key, or (causal, Lq == Lk) the keys up to
    itself."""
    return _BlockAttention.apply(q, k, v, causal)


@torch.compiler.disable  # the block plan is Python data that changes with every batch
def _decoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout
) -> torch.Tensor:
    if layout.cp is not None:
        return layout.cp(q, k, v, layout)
    return planned_attention(q, k, v, layout.blocks("local", "local"))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout | None
) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, Hkv, L, D] for the local slots. layout=None: bidirectional (ViT).
    Otherwise the decoder's mask rule (layout.py) over the layout's local slots, exact across the
    CP group when the text is sharded (layout.cp)."""
    if layout is None:
        return block_attention(q, k, v, causal=False)
    return _decoder_attention(q, k, v, layout)
