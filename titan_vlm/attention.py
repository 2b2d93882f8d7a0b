"""The one attention entry point of titan_vlm.

Model code calls `attention(q, k, v, layout, kernel)` and knows nothing about parallelism. The
`SeqLayout` it passes along was built outside the model (by the data pipeline or by
`parallel/context_parallel.py`) and says where each local token sits in its row; when the row's
text is sharded over a context-parallel group, `layout.cp` carries the algorithm that makes the
attention exact across ranks (parallel/cp_attention.py).

Mask rule (decoder, layout/): a query sees the keys of its own sample at earlier row
positions (and itself); the tokens of one image see each other causally or, with
model.image_attention = "bidirectional", all at once.

Every attention, local or context-parallel, runs *plans*: the dense and causal blocks of one
query set against one key set (layout.plan), packed into variable-length sequences
(varlen.pack) and run whole by a varlen kernel (kernels.py): one FlashAttention varlen launch per
plan and causality on CUDA, a loop over the sequences on CPU. Plans merge by log-sum-exp
(varlen.merge) where one query set meets several key sets (ring steps). The ViT's attention
(layout None) is one dense block over all its images.

The kernel is an argument, not state: `kernel` is model.attention_kernel ("auto" or a name of
kernels.KERNELS), which the model holds (VLMArgs.attention_kernel) and passes to every call; it
is resolved for the tensors' device and dtype where the attention runs (kernels.select_kernel).
It travels with the model rather than the SeqLayout because the ViT's attention has no layout,
and because the layout describes the tokens of a batch, which any model may attend over.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from titan_vlm.kernels import select_kernel
from titan_vlm.layout import Block, CPAlgorithm, LayoutHandle, SeqLayout
from titan_vlm.parallel.cp_attention import ALGORITHMS, LocalAttention
from titan_vlm.varlen import PackedPlan, float_grads, pack, run_plan, run_plan_backward

# ----------------------------------------------------------------------------------------------
# The decoder's attention as one custom op: torch.compile sees an opaque op with a fake
# implementation (shapes from its tensor arguments alone) and a registered autograd formula,
# so a compiled decoder block is one graph. The layout travels as an opaque reference object
# (LayoutHandle); `images` [B, N] and `texts` (every CP rank's [B, T]) are the layout's slot
# metadata, passed so that the fake implementation knows N, P and T symbolically. `kernel` is
# the kernel's name (a constant of the graph).


def _algorithm(layout: SeqLayout) -> CPAlgorithm:
    return layout.cp if layout.cp is not None else LocalAttention()


@torch.library.custom_op("titan_vlm::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    images: torch.Tensor,
    texts: list[torch.Tensor],
    comm: str,
    kernel: str,
    handle: LayoutHandle,
) -> list[torch.Tensor]:
    """[out, aux token, *saved] of ALGORITHMS[comm] (cp_attention.Algorithm)."""
    layout = handle.layout
    run = select_kernel(kernel, q.device, q.dtype)
    out, saved, aux = _algorithm(layout).forward(q, k, v, layout, run)
    # the memory layouts the fake promises: out [B, L, H, D] in memory, the rest contiguous
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    return [out, handle.keep(aux), *(s.contiguous() for s in saved)]


@_attention_op.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    images: torch.Tensor,
    texts: list[torch.Tensor],
    comm: str,
    kernel: str,
    handle: LayoutHandle,
) -> list[torch.Tensor]:
    b, h, length, d = q.shape
    out = q.new_empty(b, length, h, d).transpose(1, 2)
    saved = ALGORITHMS[comm].saved_like(q, k, images.shape[1], texts)
    return [out, torch.empty((), dtype=torch.long), *saved]


@torch.library.custom_op("titan_vlm::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    geometry: list[int],
    outputs: list[torch.Tensor],
    comm: str,
    kernel: str,
    handle: LayoutHandle,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `_attention_op`. q, k or v is None where ALGORITHMS[comm].keeps says its
    backward does not read it (the forward saved what it needs of it); `geometry` holds the
    sizes and strides of all three (`_geometry`), so the algorithm gets a stand-in of the same
    shape on the meta device and each gradient comes back in its input's memory layout."""
    layout = handle.layout
    run = select_kernel(kernel, dout.device, dout.dtype)
    out, token, *saved = outputs
    aux = handle.take(token)
    shapes = _shapes(geometry)
    q, k, v = (
        x if x is not None else torch.empty_strided(size, stride, dtype=dout.dtype, device="meta")
        for x, (size, stride) in zip((q, k, v), shapes)
    )
    grads = _algorithm(layout).backward(dout.contiguous(), q, k, v, out, saved, layout, run, aux)
    # each gradient in its input's memory layout, as the fake promises
    dq, dk, dv = (
        g
        if g.stride() == tuple(stride)
        else torch.empty_strided(size, stride, dtype=g.dtype, device=g.device).copy_(g)
        for g, (size, stride) in zip(grads, shapes)
    )
    return dq, dk, dv


@_attention_backward_op.register_fake
def _(
    dout: torch.Tensor,
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    geometry: list[int],
    outputs: list[torch.Tensor],
    comm: str,
    kernel: str,
    handle: LayoutHandle,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (dout.new_empty_strided(size, stride) for size, stride in _shapes(geometry))
    return dq, dk, dv


def _geometry(*xs: torch.Tensor) -> list[int]:
    """The sizes and strides of 4-d tensors, flat (the backward op's `geometry`)."""
    return [n for x in xs for n in (*x.shape, *x.stride())]


def _shapes(geometry: list[int]) -> list[tuple[list[int], list[int]]]:
    return [(geometry[i : i + 4], geometry[i + 4 : i + 8]) for i in range(0, len(geometry), 8)]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    q, k, v, _, texts, comm, kernel, handle = inputs
    # only the inputs the algorithm's backward reads: a2a and allgather keep what they need in
    # their own saved tensors, and saving q, k, v whole would cost their memory again
    keeps = ALGORITHMS[comm].keeps
    ctx.save_for_backward(*(x if keep else None for x, keep in zip((q, k, v), keeps)), *output)
    ctx.geometry = _geometry(q, k, v)
    ctx.comm, ctx.kernel, ctx.handle, ctx.texts = comm, kernel, handle, len(texts)


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    q, k, v, *outputs = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(
        grads[0], q, k, v, ctx.geometry, outputs, ctx.comm, ctx.kernel, ctx.handle
    )
    return dq, dk, dv, None, [None] * ctx.texts, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _PlannedAttention(torch.autograd.Function):
    """Attention of q over k/v under one explicit packed plan (checks and benchmarks; the model
    goes through the op above)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PackedPlan,
        kernel: str,
    ) -> torch.Tensor:
        run = select_kernel(kernel, q.device, q.dtype)
        out, lse, auxes = run_plan(run, q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (run, plan, auxes)  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        run, plan, auxes = ctx.meta
        dq, dk, dv = float_grads(q, k, v)
        run_plan_backward(run, dout.contiguous(), q, k, v, out, lse, plan, auxes, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def planned_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: PackedPlan | list[Block],
    kernel: str,
) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] under a plan: packed (SeqLayout.packed), or a block
    list, packed here in local slot order. `kernel`: as model.attention_kernel."""
    if not isinstance(plan, PackedPlan):
        b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
        plan = pack(plan, torch.arange(lq).expand(b, lq), torch.arange(lk).expand(b, lk))
    out: torch.Tensor = _PlannedAttention.apply(q, k, v, plan, kernel)
    return out


class _DenseAttention(torch.autograd.Function):
    """Every query sees every key of its row, the whole batch in one kernel launch (the ViT)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str
    ) -> torch.Tensor:
        run = select_kernel(kernel, q.device, q.dtype)
        out, lse, aux = run.dense(q, k, v, q.shape[-1] ** -0.5)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (run, aux)  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        run, aux = ctx.meta
        scale = q.shape[-1] ** -0.5
        dq, dk, dv = run.dense_backward(dout.contiguous(), q, k, v, out, lse, scale, aux)
        return dq, dk, dv, None


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> torch.Tensor:
    """Attention where every query sees every key (one dense block per batch row)."""
    out: torch.Tensor = _DenseAttention.apply(q, k, v, kernel)
    return out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout | None, kernel: str
) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, Hkv, L, D] for the local slots. layout=None: bidirectional (ViT).
    Otherwise the decoder's mask rule (layout/) over the layout's local slots, exact across the
    CP group when the text is sharded (layout.cp). `kernel`: model.attention_kernel ("auto" or a
    name of kernels.KERNELS)."""
    if layout is None:
        return dense_attention(q, k, v, kernel)
    texts = [t.order for t in layout.texts]
    out: torch.Tensor = _attention_op(
        q, k, v, layout.images.order, texts, layout.comm, kernel, layout.handle
    )[0]
    return out
