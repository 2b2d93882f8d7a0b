"""Exact attention across a context-parallel group: ring (p2p), all-to-all (Ulysses), all-gather.

Local slots on CP rank r: `[image slots (whole on every rank), r's text slots]`, the text being
r's head-tail share of each sample (layout.build_layout). Every rank knows every rank's slot
metadata, so it can plan, without communicating, the dense and causal blocks its queries need
against any rank's text (layout.plan): the algorithms below differ only in how K/V (or queries)
travel, never in which query-key pairs they compute.

    image keys       local, never communicated (every rank holds them)
    text keys        ring: rank s's text K/V arrive at step (r - s) mod P, dK/dV travel back
                     all-gather: every rank's text K/V at once, dK/dV reduce-scattered
                     all-to-all: whole sequence for H/P heads, then back

Image queries attend to the text before them in their sample (interleaved data), so every rank
computes the image queries' output in full (the same on every rank, up to merge order). In
backward each rank's image gradients cover only its own text's use of the images; the cp sum at
the image embeddings (context_parallel.py) completes them. Each algorithm keeps that contract:
summed over ranks, its image gradients are the true ones.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_vlm.attention import float_grads, planned_attention
from titan_vlm.kernels import expand_kv_heads, select_varlen
from titan_vlm.layout import SeqLayout
from titan_vlm.varlen import VarlenKernel, merge, run_plan, run_plan_backward

CP_COMM_TYPES = ("p2p", "allgather", "a2a")


def attention_plans(comm: str | None, cp: int, rank: int) -> list[tuple[str, str | int]]:
    """The plans (query slots, key slots; names as in SeqLayout.slots) one decoder attention
    runs on CP rank `rank`, in order; `comm` None: no CP. Each plan is one packed call per
    causality (varlen.pack), and plans merge by log-sum-exp."""
    if comm is None:
        return [("local", "local")]
    if comm == "p2p":
        return [("local", "local")] + [("local", (rank - s) % cp) for s in range(1, cp)]
    if comm == "allgather":
        return [("local", "all")]
    if comm == "a2a":
        return [("all", "all")]
    raise ValueError(f"parallelism.cp_comm_type must be one of {CP_COMM_TYPES}, got {comm!r}")


def kernel_launches(layout: SeqLayout, comm: str | None, kernel: VarlenKernel) -> int:
    """Attention kernel launches of one decoder layer's forward on the layout's rank (the
    backward launches as many): what `kernel` costs for every call of every plan."""
    return sum(
        kernel.launches(call)
        for queries, keys in attention_plans(comm, len(layout.texts), layout.rank)
        for call in layout.packed(queries, keys).calls
    )


class CPGroup:
    """The CP process group with this rank's coordinates and its ring neighbours."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along dim 0."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/P slice of dim 0."""
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        dist.reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=self.group)
        return out

    def shift(self, x: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start sending x to the next rank and receiving the previous rank's into a new buffer."""
        buf = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group),
            dist.P2POp(dist.irecv, buf, self.prev, self.group),
        ]
        return buf, dist.batch_isend_irecv(ops)


@functools.cache
def cp_group(mesh: DeviceMesh) -> CPGroup:
    """One CPGroup per CP mesh, made once (its neighbour look-ups are not free)."""
    return CPGroup(mesh)


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


class _RingAttention(torch.autograd.Function):
    """Step 0: this rank's queries against its local K/V (the images and its own text), one
    plan. Step s > 0: against the text K/V of rank r - s, which arrived over the ring while the
    previous step computed. Plans merge by log-sum-exp. Backward: the local plan's dK/dV stay
    here; each other rank's block has a float32 dK/dV accumulator that travels with it and
    reaches its owner after P - 1 hops."""

    @staticmethod
    def forward(ctx, q, k, v, layout: SeqLayout, g: CPGroup):
        kernel = select_varlen(q.device, q.dtype)
        n = layout.num_image_tokens
        kv = torch.stack([k[:, :, n:], v[:, :, n:]]).contiguous()  # travels the ring as one buffer
        if g.size > 1:
            incoming, reqs = g.shift(kv)  # overlapped with the local plan
        out, lse, aux_local = run_plan(kernel, q, k, v, layout.packed("local", "local"))
        out = out.float()
        aux_ring = []
        for step in range(1, g.size):
            _wait(reqs)
            kv = incoming
            if step < g.size - 1:
                incoming, reqs = g.shift(kv)  # overlapped with the plan below
            plan = layout.packed("local", (g.rank - step) % g.size)  # against the holder's text
            part_out, part_lse, aux = run_plan(kernel, q, kv[0], kv[1], plan)
            out, lse = merge(out, lse, part_out, part_lse)
            aux_ring.append(aux)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (kernel, layout, g, aux_local, aux_ring)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, layout, g, aux_local, aux_ring = ctx.meta
        n = layout.num_image_tokens
        dout = dout.contiguous()
        dq, dk, dv = float_grads(q, k, v)
        kv = torch.stack([k[:, :, n:], v[:, :, n:]]).contiguous()
        if g.size > 1:
            incoming, reqs = g.shift(kv)
        plan = layout.packed("local", "local")
        run_plan_backward(kernel, dout, q, k, v, out, lse, plan, aux_local, dq, dk, dv)
        dkv_incoming, dreqs = None, []  # the travelling dK/dV accumulator of the block in hand
        for step in range(1, g.size):
            _wait(reqs)
            kv = incoming
            if step < g.size - 1:
                incoming, reqs = g.shift(kv)
            dkv = torch.zeros_like(kv, dtype=torch.float32)  # this rank's share, block in hand
            plan = layout.packed("local", (g.rank - step) % g.size)
            run_plan_backward(
                kernel,
                dout,
                q,
                kv[0],
                kv[1],
                out,
                lse,
                plan,
                aux_ring[step - 1],
                dq,
                dkv[0],
                dkv[1],
            )
            if step > 1:
                _wait(dreqs)  # the block's accumulator, from the previous rank
                dkv += dkv_incoming
            dkv_incoming, dreqs = g.shift(dkv)  # overlapped with the next step's plan
        if g.size > 1:
            _wait(dreqs)  # after P - 1 hops our own block's accumulator is back, complete
            dk[:, :, n:] += dkv_incoming[0]
            dv[:, :, n:] += dkv_incoming[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class _CPAttention:
    def __init__(self, mesh: DeviceMesh):
        self.g = cp_group(mesh)


class RingAttention(_CPAttention):
    """cp_comm_type = "p2p": text K/V blocks travel the ring (async send/recv overlapped with the
    blocks in hand); partial results merge by log-sum-exp; in backward dK/dV travel with their
    block. A rank holds its own text K/V and one block in flight, never the whole sequence's."""

    def __call__(self, q, k, v, layout: SeqLayout) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, layout, self.g)


class _AllGatherAttention(torch.autograd.Function):
    """Gather every rank's text K/V (rank-major, the "all" slots), run this rank's queries
    against them as one plan. Backward reduce-scatters dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, layout: SeqLayout, g: CPGroup):
        kernel = select_varlen(q.device, q.dtype)
        n = layout.num_image_tokens
        kv_text = torch.stack([k[:, :, n:], v[:, :, n:]])  # [2, B, Hkv, T, D]
        # [2, B, Hkv, P*T, D], rank-major
        gathered = g.all_gather(kv_text.movedim(3, 0)).movedim(0, 3)
        k_all = torch.cat([k[:, :, :n], gathered[0]], dim=2)
        v_all = torch.cat([v[:, :, :n], gathered[1]], dim=2)
        out, lse, auxes = run_plan(kernel, q, k_all, v_all, layout.packed("local", "all"))
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.meta = (kernel, layout, g, auxes)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        kernel, layout, g, auxes = ctx.meta
        n = layout.num_image_tokens
        dq, dk_all, dv_all = float_grads(q, k_all, v_all)
        plan = layout.packed("local", "all")
        run_plan_backward(
            kernel, dout.contiguous(), q, k_all, v_all, out, lse, plan, auxes, dq, dk_all, dv_all
        )
        dkv_text = torch.stack([dk_all[:, :, n:], dv_all[:, :, n:]])
        local = g.reduce_scatter(dkv_text.movedim(3, 0)).movedim(0, 3)  # [2, B, Hkv, T, D], summed
        dk = torch.cat([dk_all[:, :, :n], local[0]], dim=2)
        dv = torch.cat([dv_all[:, :, :n], local[1]], dim=2)
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None, None


class AllGatherAttention(_CPAttention):
    """cp_comm_type = "allgather": every rank gathers the whole text K/V (simple; memory grows
    with the sequence)."""

    def __call__(self, q, k, v, layout: SeqLayout) -> torch.Tensor:
        return _AllGatherAttention.apply(q, k, v, layout, self.g)


class _AllToAll(torch.autograd.Function):
    """x [P, ...]: slice j goes to rank j; slice s of the result came from rank s. Self-inverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: CPGroup) -> torch.Tensor:
        ctx.g = g
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=g.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.g), None


class _AllGatherHeads(torch.autograd.Function):
    """[B, H/P, L, D] -> [B, H, L, D] (every rank's heads); backward reduce-scatters (sums the
    partial gradients of the replicated result and keeps this rank's heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: CPGroup) -> torch.Tensor:
        ctx.g = g
        return g.all_gather(x.movedim(1, 0)).movedim(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.g.reduce_scatter(grad.movedim(1, 0)).movedim(0, 1), None


class UlyssesAttention(_CPAttention):
    """cp_comm_type = "a2a": all-to-all from sequence-sharded to head-sharded, whole-sequence
    attention on H/P heads, all-to-all back. The replicated image tokens are not sent: each rank
    takes its own heads of them locally (so the image K/V are not counted CP-fold), and the image
    queries' output heads are all-gathered at the end."""

    def _seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's text [B, H, T, D] -> every rank's text (rank-major), this rank's heads
        [B, H/P, P*T, D]."""
        p = self.g.size
        b, h, t, d = x.shape
        y = _AllToAll.apply(
            x.reshape(b, p, h // p, t, d).movedim(1, 0), self.g
        )  # [P(src), B, H/P, T, D]
        return y.movedim(0, 2).reshape(b, h // p, p * t, d)

    def _heads_to_seq(self, y: torch.Tensor) -> torch.Tensor:
        p = self.g.size
        b, hp, length, d = y.shape
        z = y.reshape(b, hp, p, length // p, d).movedim(2, 0)
        return _AllToAll.apply(z, self.g).movedim(0, 1).reshape(b, hp * p, length // p, d)

    def __call__(self, q, k, v, layout: SeqLayout) -> torch.Tensor:
        n, p, r = layout.num_image_tokens, self.g.size, self.g.rank
        h = q.shape[1]
        if k.shape[1] % p:  # K/V heads do not split over cp: expand them to the query heads
            k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)
        hq, hk = h // p, k.shape[1] // p
        q_all = torch.cat([q[:, r * hq : (r + 1) * hq, :n], self._seq_to_heads(q[:, :, n:])], dim=2)
        k_all = torch.cat([k[:, r * hk : (r + 1) * hk, :n], self._seq_to_heads(k[:, :, n:])], dim=2)
        v_all = torch.cat([v[:, r * hk : (r + 1) * hk, :n], self._seq_to_heads(v[:, :, n:])], dim=2)
        out = planned_attention(q_all, k_all, v_all, layout.packed("all", "all"))
        text = self._heads_to_seq(out[:, :, n:])
        if n == 0:
            return text
        return torch.cat([_AllGatherHeads.apply(out[:, :, :n].contiguous(), self.g), text], dim=2)


CP_ATTENTION = {"p2p": RingAttention, "allgather": AllGatherAttention, "a2a": UlyssesAttention}
