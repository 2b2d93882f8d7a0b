"""Exact attention across a context-parallel group: ring (p2p), all-to-all (Ulysses), all-gather.

Local slots on CP rank r: `[images (N), texts[r] (T), kept[r] (W_r)]` (layout.SeqLayout): the
split samples' replicated image slots (whole on every rank), r's head-tail share of the split
samples' text (with their image slots among it where cp_image_tokens = "shard": they travel
as text does), and the samples r keeps whole (cp_sample_placement = "auto"). Every rank knows every
rank's slot metadata, so it can plan, without communicating, the dense and causal blocks its
queries need against any rank's text (layout.plan): the algorithms below differ only in how K/V
(or queries) travel, never in which query-key pairs they compute. Only the T travelling slots
cross the group: ranks may hold different W_r, which no rank needs to be told.

    image keys       replicated ones local, never communicated (every rank holds them);
                     sharded ones are text slots here
    kept slots       local, never communicated (no other rank's query sees them)
    text keys        ring: rank s's text K/V arrive at step (r - s) mod P, dK/dV travel back
                     all-gather: every rank's text K/V at once, dK/dV reduce-scattered
                     all-to-all: images + every rank's text for H/P heads, then back; the kept
                     slots in a plan of their own on all heads

Replicated image queries attend to the text before them in their sample (interleaved data), so
every rank computes their output in full (the same on every rank, up to merge order); a sharded
image's queries are computed once, by the rank holding them. In backward each rank's image
gradients cover only its own slots' use of the images; the cp sum at
the image embeddings (context_parallel.py) completes them. Each algorithm keeps that contract:
summed over ranks, its image gradients are the true ones.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_vlm.layout import SeqLayout
from titan_vlm.varlen import VarlenKernel, float_grads, merge, run_plan, run_plan_backward


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
        return [("shared", "shared"), ("kept", "kept")]
    raise ValueError(f"parallelism.cp_comm_type must be one of {tuple(CP_ATTENTION)}, got {comm!r}")


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

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, ...]: slice j goes to rank j; slice s of the result came from rank s."""
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out

    def shift(self, x: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
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


def _wait(reqs: list[dist.Work]) -> None:
    for req in reqs:
        req.wait()


class Algorithm:
    """One attention algorithm as a forward/backward pair without autograd (the custom op in
    attention_op.py wraps them). forward(q, k, v, layout) -> (out, saved, aux): `saved` are the
    tensors its backward needs besides out and the inputs it `keeps` (the log-sum-exp first),
    `aux` what the kernels' backward needs that is not a tensor. `saved_like` builds `saved`
    from shapes alone (the op's fake implementation): `n` image slots, `texts` [B, T] of every
    CP rank. `keeps`: which of q, k, v its backward reads (the op saves only those; the others
    reach backward as meta tensors of their shape, so it must read only their shapes)."""

    comm = "abstract"
    keeps = (True, True, True)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: SeqLayout,
        kernel: VarlenKernel,
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        raise NotImplementedError

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        saved: list[torch.Tensor],
        layout: SeqLayout,
        kernel: VarlenKernel,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def saved_like(
        q: torch.Tensor, k: torch.Tensor, n: int, texts: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        return [_lse_like(q, q.shape[1], q.shape[2])]


def _lse_like(q: torch.Tensor, heads: int, length: int) -> torch.Tensor:
    dtype = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(q.shape[0], heads, length, dtype=dtype)


class LocalAttention(Algorithm):
    """No CP: the local slots against themselves, one plan."""

    comm = "local"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: SeqLayout,
        kernel: VarlenKernel,
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        out, lse, aux = run_plan(kernel, q, k, v, layout.packed("local", "local"))
        return out, [lse], aux

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        saved: list[torch.Tensor],
        layout: SeqLayout,
        kernel: VarlenKernel,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        auxes = aux
        dq, dk, dv = float_grads(q, k, v)
        plan = layout.packed("local", "local")
        run_plan_backward(kernel, dout, q, k, v, out, saved[0], plan, auxes, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _CPAttention(Algorithm):
    def __init__(self, mesh: DeviceMesh):
        self.g = cp_group(mesh)


class RingAttention(_CPAttention):
    """cp_comm_type = "p2p": ring attention. Step 0: this rank's queries against its local K/V
    (the images and its own text), one plan, while its text K/V start around the ring. Step
    s > 0: against the text K/V of rank r - s, which arrived while the previous step computed.
    Plans merge by log-sum-exp. Backward: the local plan's dK/dV stay here; each other rank's
    block has a float32 dK/dV accumulator that travels with it and reaches its owner after P - 1
    hops. A rank holds its own text K/V and one block in flight, never the whole sequence's."""

    comm = "p2p"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: SeqLayout,
        kernel: VarlenKernel,
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        g = self.g
        n, t = layout.num_image_tokens, layout.travel
        # this rank's split-sample text travels the ring as one buffer
        kv = torch.stack([k[:, :, n : n + t], v[:, :, n : n + t]]).contiguous()
        if g.size > 1:
            incoming, reqs = g.shift(kv)  # overlapped with the local plan
        out, lse, aux_local = run_plan(kernel, q, k, v, layout.packed("local", "local"))
        out = out.float()
        aux_ring: list[list[Any]] = []
        for step in range(1, g.size):
            _wait(reqs)
            kv = incoming
            if step < g.size - 1:
                incoming, reqs = g.shift(kv)  # overlapped with the plan below
            plan = layout.packed("local", (g.rank - step) % g.size)  # against the holder's text
            part_out, part_lse, aux = run_plan(kernel, q, kv[0], kv[1], plan)
            out, lse = merge(out, lse, part_out, part_lse)
            aux_ring.append(aux)
        return out.to(q.dtype), [lse], (aux_local, aux_ring)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        saved: list[torch.Tensor],
        layout: SeqLayout,
        kernel: VarlenKernel,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = self.g
        aux_local, aux_ring = aux
        lse = saved[0]
        n, t = layout.num_image_tokens, layout.travel
        dq, dk, dv = float_grads(q, k, v)
        kv = torch.stack([k[:, :, n : n + t], v[:, :, n : n + t]]).contiguous()
        if g.size > 1:
            incoming, reqs = g.shift(kv)
        plan = layout.packed("local", "local")
        run_plan_backward(kernel, dout, q, k, v, out, lse, plan, aux_local, dq, dk, dv)
        # the travelling dK/dV accumulator of the block in hand (from step 1 on)
        dkv_incoming: torch.Tensor | None = None
        dreqs: list[dist.Work] = []
        for step in range(1, g.size):
            _wait(reqs)
            kv = incoming
            if step < g.size - 1:
                incoming, reqs = g.shift(kv)
            dkv = torch.zeros_like(kv, dtype=torch.float32)  # this rank's share, block in hand
            plan = layout.packed("local", (g.rank - step) % g.size)
            run_plan_backward(
                kernel, dout, q, kv[0], kv[1], out, lse, plan, aux_ring[step - 1], dq, *dkv
            )
            if dkv_incoming is not None:
                _wait(dreqs)  # the block's accumulator, from the previous rank
                dkv += dkv_incoming
            dkv_incoming, dreqs = g.shift(dkv)  # overlapped with the next step's plan
        if dkv_incoming is not None:
            _wait(dreqs)  # after P - 1 hops our own block's accumulator is back, complete
            dk[:, :, n : n + t] += dkv_incoming[0]
            dv[:, :, n : n + t] += dkv_incoming[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class AllGatherAttention(_CPAttention):
    """cp_comm_type = "allgather": gather every rank's text K/V (rank-major, the "all" slots)
    and run this rank's queries against them as one plan (simple; memory grows with the
    sequence). Backward reduce-scatters dK/dV. Its saved K/V (the gathered ones, which hold this
    rank's) are all its backward reads of k and v."""

    comm = "allgather"
    keeps = (True, False, False)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: SeqLayout,
        kernel: VarlenKernel,
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        n, t = layout.num_image_tokens, layout.travel
        kv_text = torch.stack([k[:, :, n : n + t], v[:, :, n : n + t]])  # [2, B, Hkv, T, D]
        # [2, B, Hkv, P*T, D], rank-major
        gathered = self.g.all_gather(kv_text.movedim(3, 0)).movedim(0, 3)
        k_all = torch.cat([k[:, :, :n], gathered[0], k[:, :, n + t :]], dim=2)
        v_all = torch.cat([v[:, :, :n], gathered[1], v[:, :, n + t :]], dim=2)
        out, lse, aux = run_plan(kernel, q, k_all, v_all, layout.packed("local", "all"))
        return out, [lse, k_all, v_all], aux

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        saved: list[torch.Tensor],
        layout: SeqLayout,
        kernel: VarlenKernel,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        auxes = aux
        lse, k_all, v_all = saved
        n, end = layout.num_image_tokens, layout.num_image_tokens + self.g.size * layout.travel
        dq, dk_all, dv_all = float_grads(q, k_all, v_all)
        plan = layout.packed("local", "all")
        run_plan_backward(kernel, dout, q, k_all, v_all, out, lse, plan, auxes, dq, dk_all, dv_all)
        dkv_text = torch.stack([dk_all[:, :, n:end], dv_all[:, :, n:end]])
        local = self.g.reduce_scatter(dkv_text.movedim(3, 0)).movedim(0, 3)  # [2, B, Hkv, T, D]
        dk = torch.cat([dk_all[:, :, :n], local[0], dk_all[:, :, end:]], dim=2)
        dv = torch.cat([dv_all[:, :, :n], local[1], dv_all[:, :, end:]], dim=2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def saved_like(
        q: torch.Tensor, k: torch.Tensor, n: int, texts: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        # the local slots with every rank's text in place of this rank's
        length = q.shape[2] + (len(texts) - 1) * texts[0].shape[1]
        kv = k.new_empty(k.shape[0], k.shape[1], length, k.shape[3])
        return [_lse_like(q, q.shape[1], q.shape[2]), kv, torch.empty_like(kv)]


def a2a_kv_heads(heads: int, kv_heads: int, cp: int) -> list[list[int]]:
    """The K/V heads each CP rank receives in the all-to-all (`UlyssesAttention`), in order.

    Rank r computes query heads [r H/P, (r+1) H/P); query head j uses K/V head j // (H/Hkv).
    With G = gcd(H/P, H/Hkv), every run of G consecutive query heads of a rank uses one K/V
    head, so rank r receives the K/V heads of its runs, (r H/P + i G) // (H/Hkv) for
    i < H/P / G, and its local query head j uses its local K/V head j // G: the kernels' own
    grouped-query mapping, no copies per query head. A K/V head that several ranks use is sent
    to each of them (replicated to the ranks sharing it, never to all H query heads).

        H=4, Hkv=2, P=2:  rank 0 [0], rank 1 [1]        (the K/V heads split over cp)
        H=4, Hkv=1, P=2:  rank 0 [0], rank 1 [0]        (1 head each, not H/P = 2)
        H=4, Hkv=2, P=4:  [0], [0], [1], [1]
    """
    local = heads // cp
    group = heads // kv_heads
    run = math.gcd(local, group)
    return [[(r * local + i * run) // group for i in range(local // run)] for r in range(cp)]


class UlyssesAttention(_CPAttention):
    """cp_comm_type = "a2a": all-to-all from sequence-sharded to head-sharded, attention over
    the split samples' whole sequence on H/P query heads (one plan), all-to-all back; the samples
    this rank keeps whole attend locally on all heads (a second plan, "kept"). The replicated image
    tokens are not sent: each rank takes its own heads of them locally (so the image K/V are not
    counted CP-fold), and the image queries' output heads are all-gathered at the end. Each rank
    gets only the K/V heads its query heads use (`a2a_kv_heads`); the kernel maps its query
    heads to them (grouped-query, fewer K/V heads than query heads). Backward sends every K/V
    head's gradient back to the rank that holds its text and sums the copies there. It saves its
    own head-sharded q, k, v and copies of the kept slots' q, k, v: nothing of the local q, k, v
    beyond those (`keeps`)."""

    comm = "a2a"
    keeps = (False, False, False)

    def _seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's text for every rank's heads, rank-major [B, P*h, T, D] -> every rank's
        text (rank-major), this rank's h heads [B, h, P*T, D]."""
        p = self.g.size
        b, h, t, d = x.shape
        y = self.g.all_to_all(x.reshape(b, p, h // p, t, d).movedim(1, 0))  # [P(src), B, h..]
        return y.movedim(0, 2).reshape(b, h // p, p * t, d)

    def _heads_to_seq(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `_seq_to_heads`."""
        p = self.g.size
        b, hp, length, d = y.shape
        z = self.g.all_to_all(y.reshape(b, hp, p, length // p, d).movedim(2, 0))
        return z.movedim(0, 1).reshape(b, hp * p, length // p, d)

    def _gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H/P, L, ...] -> [B, H, L, ...] (every rank's heads)."""
        return self.g.all_gather(x.movedim(1, 0)).movedim(0, 1)

    def _owned(self, x: torch.Tensor, q: torch.Tensor) -> list[list[int]] | None:
        """The heads of x (q, k or v) each rank receives; None: rank r gets the r-th 1/P of
        them (query heads, and K/V heads that split over cp)."""
        owned = a2a_kv_heads(q.shape[1], x.shape[1], self.g.size)
        split = [h for heads in owned for h in heads] == list(range(x.shape[1]))
        return None if split else owned

    def _split(self, x: torch.Tensor, n: int, owned: list[list[int]] | None) -> torch.Tensor:
        """This rank's heads of the image slots, every rank's text for them: [B, h, n + P*T]."""
        if owned is None:
            hp, r = x.shape[1] // self.g.size, self.g.rank
            return torch.cat([x[:, r * hp : (r + 1) * hp, :n], self._seq_to_heads(x[:, :, n:])], 2)
        mine = x[:, :, :n].index_select(1, torch.tensor(owned[self.g.rank], device=x.device))
        every = torch.tensor([h for heads in owned for h in heads], device=x.device)
        return torch.cat([mine, self._seq_to_heads(x[:, :, n:].index_select(1, every))], 2)

    def _split_backward(
        self, dx_all: torch.Tensor, heads: int, n: int, owned: list[list[int]] | None
    ) -> torch.Tensor:
        """The gradient of `_split` (x with `heads` heads): my heads of the image slots, the
        text sent back; copies of a head (`owned`) summed."""
        b, hx, length, d = dx_all.shape
        length = n + (length - n) // self.g.size
        text = self._heads_to_seq(dx_all[:, :, n:].contiguous())
        dx = dx_all.new_zeros(b, heads, length, d)
        if owned is None:
            r = self.g.rank
            dx[:, r * hx : (r + 1) * hx, :n] = dx_all[:, :, :n]
            dx[:, :, n:] = text
            return dx
        mine = torch.tensor(owned[self.g.rank], device=dx.device)
        every = torch.tensor([h for heads in owned for h in heads], device=dx.device)
        dx[:, :, :n].index_add_(1, mine, dx_all[:, :, :n])
        dx[:, :, n:].index_add_(1, every, text)
        return dx

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: SeqLayout,
        kernel: VarlenKernel,
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        n = layout.num_image_tokens
        owned = self._owned(k, q)
        (qs, qk), (ks, kk), (vs, vk) = (_shared_and_kept(x, layout) for x in (q, k, v))
        q_all = self._split(qs, n, None)
        k_all, v_all = self._split(ks, n, owned), self._split(vs, n, owned)
        out_all, lse_all, aux = run_plan(
            kernel, q_all, k_all, v_all, layout.packed("shared", "shared")
        )
        text = self._heads_to_seq(out_all[:, :, n:])
        out_shared = torch.cat([self._gather_heads(out_all[:, :, :n].contiguous()), text], dim=2)
        # the slots kept whole on this rank: every head here, nothing travels
        out_kept, lse_kept, aux_kept = run_plan(kernel, qk, kk, vk, layout.packed("kept", "kept"))
        out = torch.cat([out_shared, out_kept], dim=2)
        # what backward reads of q, k, v: the kept slots (copies: the op saves no input whole)
        kept = [x.clone(memory_format=torch.contiguous_format) for x in (qk, kk, vk)]
        return out, [lse_all, q_all, k_all, v_all, out_all, lse_kept, *kept], (aux, aux_kept)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        saved: list[torch.Tensor],
        layout: SeqLayout,
        kernel: VarlenKernel,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse_all, q_all, k_all, v_all, out_all, lse_kept, qk, kk, vk = saved
        aux_all, aux_kept = aux
        n = layout.num_image_tokens
        dout_s, dout_k = _shared_and_kept(dout, layout)
        # the image outputs were all-gathered by head: sum every rank's gradient of my heads
        d_img = self.g.reduce_scatter(dout_s[:, :, :n].movedim(1, 0)).movedim(0, 1)
        dout_all = torch.cat([d_img, self._seq_to_heads(dout_s[:, :, n:])], dim=2)
        plan = layout.packed("shared", "shared")
        dq_all, dk_all, dv_all = float_grads(q_all, k_all, v_all)
        run_plan_backward(
            kernel,
            dout_all,
            q_all,
            k_all,
            v_all,
            out_all,
            lse_all,
            plan,
            aux_all,
            dq_all,
            dk_all,
            dv_all,
        )
        owned = self._owned(k, q)
        dq_s = self._split_backward(dq_all, q.shape[1], n, None)
        dk_s = self._split_backward(dk_all, k.shape[1], n, owned)
        dv_s = self._split_backward(dv_all, v.shape[1], n, owned)
        out_k = _shared_and_kept(out, layout)[1]
        dq_k, dk_k, dv_k = float_grads(qk, kk, vk)
        kept = layout.packed("kept", "kept")
        run_plan_backward(
            kernel, dout_k, qk, kk, vk, out_k, lse_kept, kept, aux_kept, dq_k, dk_k, dv_k
        )
        dq, dk, dv = (
            torch.cat(parts, dim=2) for parts in ((dq_s, dq_k), (dk_s, dk_k), (dv_s, dv_k))
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def saved_like(
        q: torch.Tensor, k: torch.Tensor, n: int, texts: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        p, t = len(texts), texts[0].shape[1]
        b, h, local, d = q.shape
        length = n + p * t
        hk = len(a2a_kv_heads(h, k.shape[1], p)[0])
        q_all = q.new_empty(b, h // p, length, d)
        k_all = k.new_empty(b, hk, length, d)
        w = local - n - t  # the kept slots
        qk, kk = q.new_empty(b, h, w, d), k.new_empty(b, k.shape[1], w, d)
        return [
            _lse_like(q, h // p, length),
            q_all,
            k_all,
            torch.empty_like(k_all),
            torch.empty_like(q_all),
            _lse_like(q, h, w),
            qk,
            kk,
            torch.empty_like(kk),
        ]


def _shared_and_kept(x: torch.Tensor, layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, L, ...] over the local slots -> (the split samples' slots `[images, this rank's
    text]`, the slots of the samples kept whole here), along dim 2; torch.cat of the two along
    dim 2 is x again."""
    end = layout.num_image_tokens + layout.travel
    return x[:, :, :end], x[:, :, end:]


# parallelism.cp_comm_type -> the algorithm: the one registry of CP algorithms (the config,
# the planner and the benchmarks take the names from here)
CP_ATTENTION: dict[str, type[_CPAttention]] = {
    "p2p": RingAttention,
    "allgather": AllGatherAttention,
    "a2a": UlyssesAttention,
}
# the op's `comm` argument -> the algorithm ("local": no CP)
ALGORITHMS: dict[str, type[Algorithm]] = {"local": LocalAttention, **CP_ATTENTION}
