"""The one attention entry point of titan_vlm, and its pluggable block kernels.

Model code calls `attention(q, k, v, layout)` and knows nothing about parallelism. The
`SeqLayout` it passes along was built outside the model (by the data pipeline or by
`parallel/context_parallel.py`) and says where each local token sits in its row; when the row's
text is sharded over a context-parallel group, `layout.cp` carries the algorithm that makes the
attention exact across ranks (parallel/cp_attention.py).

Mask rule (decoder): a query at row position p sees every key at position <= p. The image
tokens of a row come first, so every text query sees the whole image prefix and the image
queries see only image keys.

Every attention, local or context-parallel, is computed from blocks by one `BlockKernel`:
forward(q, k, v, causal) -> (out, log-sum-exp), and a backward that takes the final (merged)
out and lse. Blocks are either dense or causal on the diagonal, so no kernel needs an
arbitrary mask. Adding a kernel is adding a class to `KERNELS` (and, to make it the default
somewhere, a line to `select_kernel`); `model.attention_kernel` can force any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

aten = torch.ops.aten


class CPAttention(Protocol):
    """A context-parallel attention algorithm (see parallel/cp_attention.py)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout) -> torch.Tensor: ...


@dataclass
class SeqLayout:
    """Where the local tokens of each row sit in the (unsharded) row.

    positions: [1 or B, L] row position of each local token (the RoPE position). The first
        `num_image_tokens` local tokens are the row's image tokens (whole on every CP rank); the
        rest is text.
    cp: None: the tokens are the whole row in row order, and the mask is plain causal.
        Set: the text is sharded over a CP group in the head-tail layout (two equal chunks, r and
        2P-1-r, context_parallel.shard_text); the CP algorithm relies on that layout.
    """

    positions: torch.Tensor
    num_image_tokens: int
    cp: CPAttention | None = None

    @classmethod
    def unsharded(cls, seq_len: int, num_image_tokens: int, device: torch.device | str = "cpu") -> SeqLayout:
        return cls(positions=torch.arange(seq_len, device=device).unsqueeze(0), num_image_tokens=num_image_tokens)


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, aux: Any) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class CpuFlash(BlockKernel):
    """aten's CPU flash attention (fp32/bf16), which returns the log-sum-exp."""

    name = "cpu_flash"
    device_type = "cpu"

    def forward(self, q, k, v, causal, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=None, scale=scale)


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
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dout, q, k, v, out = _dense(dout, q, k, v, out)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


class CudaEfficient(BlockKernel):
    """Memory-efficient attention through aten (CUDA, fp32/bf16/fp16). Its lse is padded along
    the query dim to a multiple of 32; we hand out the first Lq rows and pad back in backward."""

    name = "cuda_efficient"
    device_type = "cuda"

    def forward(self, q, k, v, causal, scale):
        q, k, v = _dense(q, k, v)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        seed, offset, lse_len = aux
        lse = torch.nn.functional.pad(lse, (0, lse_len - lse.shape[-1])).contiguous()
        dout, q, k, v, out = _dense(dout, q, k, v, out)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv


class CudaCudnn(BlockKernel):
    """cuDNN attention through aten (CUDA, fp16/bf16). Its lse keeps a trailing dim of 1."""

    name = "cuda_cudnn"
    device_type = "cuda"

    def forward(self, q, k, v, causal, scale):
        q, k, v = _dense(q, k, v)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, lse.reshape(q.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset, lse.shape)

    def backward(self, dout, q, k, v, out, lse, causal, scale, aux):
        cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = aux
        dout, q, k, v, out = _dense(dout, q, k, v, out)
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.reshape(lse_shape).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k,
            0.0, causal, scale=scale)


KERNELS: dict[str, BlockKernel] = {k.name: k for k in (CpuFlash(), CudaFlash(), CudaEfficient(), CudaCudnn())}
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
            raise RuntimeError(f"model.attention_kernel={_forced.name} runs on {_forced.device_type}, "
                               f"the tensors are on {device.type}")
        return _forced
    if device.type == "cpu":
        return KERNELS["cpu_flash"]
    if device.type == "cuda":
        return KERNELS["cuda_flash" if dtype in (torch.float16, torch.bfloat16) else "cuda_efficient"]
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


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's result into the float32 accumulators (in place), exactly:
    lse' = log(e^lse + e^lse_b); out' = e^(lse - lse') out + e^(lse_b - lse') out_b."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1))
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
        return self.kernel.forward(q, expand_kv_heads(k, h), expand_kv_heads(v, h), causal, self.scale)

    def backward(self, dout, q, k, v, out, lse, causal, aux):
        n_kv, h = k.shape[1], self.heads
        dq, dk, dv = self.kernel.backward(dout, q, expand_kv_heads(k, h), expand_kv_heads(v, h), out, lse,
                                          causal, self.scale, aux)
        return dq, reduce_kv_heads(dk, n_kv), reduce_kv_heads(dv, n_kv)


class _BlockAttention(torch.autograd.Function):
    """One dense or causal block through the kernel."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
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


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention of one block: every query sees every key, or (causal, Lq == Lk) the keys up to itself."""
    return _BlockAttention.apply(q, k, v, causal)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout | None) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, Hkv, L, D] for the local tokens. layout=None: bidirectional (ViT)."""
    if layout is None:
        return block_attention(q, k, v, causal=False)
    if layout.cp is not None:
        return layout.cp(q, k, v, layout)
    # Unsharded row, tokens in row order: [image prefix, text] is one causal block.
    return block_attention(q, k, v, causal=True)
