"""Exact attention across a context-parallel group: ring (p2p), all-to-all (Ulysses), all-gather.

Local tokens on CP rank r: `[image tokens (n, whole on every rank), text chunk r, text chunk
2P-1-r]`, chunks of c tokens (head-tail layout, context_parallel.py). Keys visible to a query at
row position p: every key at position <= p. So, for the text:

    image keys             dense for every text query; local, never communicated
    own text chunks        one causal block (the two chunks are in row order)
    rank s's chunks, s<r   both of my chunks see s's head chunk densely, not its tail
    rank s's chunks, s>r   my tail chunk sees both of s's chunks densely, my head sees neither

Every ring step is therefore one dense block of (2c x c) or (c x 2c) query-key pairs: the same
work on every rank at every step. Image queries see the image keys causally (local).

Gradients reaching the image K/V (and the image queries' inputs) on rank r cover only rank r's
text; the cp all-reduce at the image embeddings (context_parallel.py) completes them. Each
algorithm here keeps that contract: summed over ranks, its image gradients are the true ones.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_vlm.attention import Blocks, SeqLayout, block_attention, expand_kv_heads, merge_into

CP_COMM_TYPES = ("p2p", "allgather", "a2a")


def natural_chunk_order(cp_size: int) -> torch.Tensor:
    """Gathered text is rank-major: [r0: c0 c_{2P-1}] [r1: c1 c_{2P-2}] ...; entry j of the result
    is the gathered slot of natural chunk j."""
    return torch.tensor([2 * j if j < cp_size else 2 * (2 * cp_size - 1 - j) + 1 for j in range(2 * cp_size)])


def _to_natural(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[B, H, 2P*c, D] rank-major gathered text -> row order."""
    b, h, length, d = x.shape
    chunks = x.reshape(b, h, len(order), length // len(order), d)
    return chunks.index_select(2, order.to(x.device)).reshape(b, h, length, d)


def _to_gathered(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of `_to_natural`."""
    return _to_natural(x, torch.argsort(order))


class CPGroup:
    """The CP process group with this rank's coordinates and its ring neighbours."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self.order = natural_chunk_order(self.size)

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
        ops = [dist.P2POp(dist.isend, x, self.next, self.group), dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        return buf, dist.batch_isend_irecv(ops)


@functools.lru_cache(maxsize=None)
def cp_group(mesh: DeviceMesh) -> CPGroup:
    """One CPGroup per CP mesh, made once (its neighbour look-ups are not free)."""
    return CPGroup(mesh)


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


def _accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 output and lse accumulators for q's rows: nothing seen yet (out 0, lse -inf)."""
    return torch.zeros_like(q, dtype=torch.float32), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)


Schedule = list[tuple[slice, slice, bool]]  # (query rows, key rows, causal) of local blocks


def _blocks_forward(blocks: Blocks, q, k, v, schedule: Schedule, out, lse) -> list:
    """Run blocks whose K/V are all local, merging into the out/lse accumulators; their auxes."""
    auxes = []
    for rows, keys, causal in schedule:
        o, block_lse, aux = blocks.forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal)
        merge_into(out[:, :, rows], lse[:, :, rows], o, block_lse)
        auxes.append(aux)
    return auxes


def _blocks_backward(blocks: Blocks, dout, q, k, v, out, lse, schedule: Schedule, auxes, dq, dk, dv) -> None:
    """Backward of `_blocks_forward` with the final out/lse, accumulating into dq/dk/dv."""
    for (rows, keys, causal), aux in zip(schedule, auxes):
        dq_, dk_, dv_ = blocks.backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                        out[:, :, rows], lse[:, :, rows], causal, aux)
        dq[:, :, rows] += dq_
        dk[:, :, keys] += dk_
        dv[:, :, keys] += dv_


def _image_schedule(n: int) -> Schedule:
    """The replicated image prefix: image queries over image keys (causal), text queries over
    image keys (dense). Local on every rank."""
    return [(slice(0, n), slice(0, n), True), (slice(n, None), slice(0, n), False)] if n > 0 else []


def _ring_block(step: int, src: int, rank: int, c: int) -> tuple[slice, slice, bool]:
    """(local text query rows, rows of src's text K/V, causal) of ring step `step`."""
    if step == 0:
        return slice(None), slice(None), True  # own two chunks, in row order: one causal block
    if src < rank:
        return slice(None), slice(0, c), False  # both my chunks see src's head chunk
    return slice(c, None), slice(None), False  # only my tail chunk sees src's two chunks


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, n: int, g: CPGroup):
        blocks = Blocks(q)
        c = (q.shape[2] - n) // 2
        qt = q[:, :, n:]
        out, lse = _accumulators(q)
        out_t, lse_t = out[:, :, n:], lse[:, :, n:]
        aux_img = _blocks_forward(blocks, q, k, v, _image_schedule(n), out, lse)  # never sent
        kv = torch.stack([k[:, :, n:], v[:, :, n:]]).contiguous()  # travels the ring as one buffer
        aux_ring = []
        for step in range(g.size):
            if step < g.size - 1:
                incoming, reqs = g.shift(kv)  # overlapped with the block below
            rows, keys, causal = _ring_block(step, (g.rank - step) % g.size, g.rank, c)
            o, block_lse, aux = blocks.forward(qt[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal)
            merge_into(out_t[:, :, rows], lse_t[:, :, rows], o, block_lse)
            aux_ring.append(aux)
            if step < g.size - 1:
                _wait(reqs)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (n, g, aux_img, aux_ring)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        n, g, aux_img, aux_ring = ctx.meta
        blocks = Blocks(q)
        c = (q.shape[2] - n) // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        _blocks_backward(blocks, dout, q, k, v, out, lse, _image_schedule(n), aux_img, dq, dk, dv)
        qt, dq_t, dout_t, out_t, lse_t = q[:, :, n:], dq[:, :, n:], dout[:, :, n:], out[:, :, n:], lse[:, :, n:]
        kv = torch.stack([k[:, :, n:], v[:, :, n:]]).contiguous()
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # gradient of the block in hand; travels with it
        dkv_incoming, dreqs = dkv, []  # set by the first step's shift
        for step in range(g.size):
            if step < g.size - 1:
                incoming, reqs = g.shift(kv)
            rows, keys, causal = _ring_block(step, (g.rank - step) % g.size, g.rank, c)
            dq_, dk_, dv_ = blocks.backward(dout_t[:, :, rows], qt[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                                            out_t[:, :, rows], lse_t[:, :, rows], causal, aux_ring[step])
            dq_t[:, :, rows] += dq_
            if step > 0:
                _wait(dreqs)  # the accumulator of this block, from the previous rank
                dkv = dkv_incoming
            dkv[0][:, :, keys] += dk_
            dkv[1][:, :, keys] += dv_
            dkv_incoming, dreqs = g.shift(dkv)  # overlapped with the next step's block
            if step < g.size - 1:
                _wait(reqs)
                kv = incoming
        _wait(dreqs)  # after P hops our own block's accumulator is back, complete
        dk[:, :, n:] += dkv_incoming[0]
        dv[:, :, n:] += dkv_incoming[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class _CPAttention:
    def __init__(self, mesh: DeviceMesh):
        self.g = cp_group(mesh)


class RingAttention(_CPAttention):
    """cp_comm_type = "p2p": text K/V blocks travel the ring (async send/recv overlapped with the
    block in hand); partial results merge by log-sum-exp; in backward dK/dV travel with their
    block. A rank holds its own text K/V and one block in flight, never the whole sequence's."""

    def __call__(self, q, k, v, layout: SeqLayout) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, layout.num_image_tokens, self.g)


def _allgather_blocks(n: int, c: int, g: CPGroup) -> Schedule:
    """(local query rows, key rows of the row-order sequence, causal) of the all-gather method."""
    out = [(slice(0, n), slice(0, n), True)] if n > 0 else []
    for half, chunk in ((0, g.rank), (1, 2 * g.size - 1 - g.rank)):
        rows, start = slice(n + half * c, n + (half + 1) * c), n + chunk * c
        if start > 0:
            out.append((rows, slice(0, start), False))  # everything before the chunk
        out.append((rows, slice(start, start + c), True))  # the chunk's own diagonal
    return out


class _AllGatherAttention(torch.autograd.Function):
    """Gather all text K/V (row order), then per local query chunk: a dense block over every key
    before the chunk and a causal block on the diagonal. Backward reduce-scatters dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, n: int, g: CPGroup):
        blocks = Blocks(q)
        c = (q.shape[2] - n) // 2
        kv_text = torch.stack([k[:, :, n:], v[:, :, n:]])  # [2, B, Hkv, 2c, D]
        gathered = g.all_gather(kv_text.movedim(3, 0)).movedim(0, 3)  # [2, B, Hkv, P*2c, D], rank-major
        k_all = torch.cat([k[:, :, :n], _to_natural(gathered[0], g.order)], dim=2)  # row order
        v_all = torch.cat([v[:, :, :n], _to_natural(gathered[1], g.order)], dim=2)
        out, lse = _accumulators(q)
        auxes = _blocks_forward(blocks, q, k_all, v_all, _allgather_blocks(n, c, g), out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.meta = (n, c, g, auxes)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        n, c, g, auxes = ctx.meta
        blocks = Blocks(q)
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk_all = torch.zeros_like(k_all, dtype=torch.float32)
        dv_all = torch.zeros_like(v_all, dtype=torch.float32)
        _blocks_backward(blocks, dout, q, k_all, v_all, out, lse, _allgather_blocks(n, c, g), auxes, dq, dk_all, dv_all)
        dkv_text = torch.stack([_to_gathered(dk_all[:, :, n:], g.order), _to_gathered(dv_all[:, :, n:], g.order)])
        local = g.reduce_scatter(dkv_text.movedim(3, 0)).movedim(0, 3)  # [2, B, Hkv, 2c, D], summed
        dk = torch.cat([dk_all[:, :, :n], local[0]], dim=2)
        dv = torch.cat([dv_all[:, :, :n], local[1]], dim=2)
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None, None


class AllGatherAttention(_CPAttention):
    """cp_comm_type = "allgather": every rank gathers the whole text K/V (simple; memory grows
    with the sequence)."""

    def __call__(self, q, k, v, layout: SeqLayout) -> torch.Tensor:
        return _AllGatherAttention.apply(q, k, v, layout.num_image_tokens, self.g)


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
        """This rank's text [B, H, T, D] -> all text, row order, this rank's heads [B, H/P, P*T, D]."""
        p = self.g.size
        b, h, t, d = x.shape
        y = _AllToAll.apply(x.reshape(b, p, h // p, t, d).movedim(1, 0), self.g)  # [P(src), B, H/P, T, D]
        return _to_natural(y.movedim(0, 2).reshape(b, h // p, p * t, d), self.g.order)

    def _heads_to_seq(self, y: torch.Tensor) -> torch.Tensor:
        p = self.g.size
        b, hp, length, d = y.shape
        z = _to_gathered(y, self.g.order).reshape(b, hp, p, length // p, d).movedim(2, 0)
        return _AllToAll.apply(z, self.g).movedim(0, 1).reshape(b, hp * p, length // p, d)

    def __call__(self, q, k, v, layout: SeqLayout) -> torch.Tensor:
        n, p, r = layout.num_image_tokens, self.g.size, self.g.rank
        h = q.shape[1]
        if k.shape[1] % p:  # K/V heads do not split over cp: expand them to the query heads
            k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)
        hq, hk = h // p, k.shape[1] // p
        q_all = torch.cat([q[:, r * hq:(r + 1) * hq, :n], self._seq_to_heads(q[:, :, n:])], dim=2)
        k_all = torch.cat([k[:, r * hk:(r + 1) * hk, :n], self._seq_to_heads(k[:, :, n:])], dim=2)
        v_all = torch.cat([v[:, r * hk:(r + 1) * hk, :n], self._seq_to_heads(v[:, :, n:])], dim=2)
        out = block_attention(q_all, k_all, v_all, causal=True)  # row order: one causal block
        text = self._heads_to_seq(out[:, :, n:])
        if n == 0:
            return text
        return torch.cat([_AllGatherHeads.apply(out[:, :, :n].contiguous(), self.g), text], dim=2)


CP_ATTENTION = {"p2p": RingAttention, "allgather": AllGatherAttention, "a2a": UlyssesAttention}
