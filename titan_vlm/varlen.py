"""A block plan packed into variable-length sequences, and the executor that runs it whole.

A block plan (layout.plan) lists the dense and causal blocks of one query set against one key
set (e.g. a rank's local slots against one ring step's text). Calling a kernel per block costs a
launch and a log-sum-exp merge per block, and the number of blocks grows with the samples and
images of a row. `pack` turns the whole plan into at most two variable-length calls, the form
FlashAttention's varlen kernel takes (`cu_seqlens` for queries and keys):

- each query slot of the plan lies in exactly one *sequence*, whose keys are all the keys that
  query sees, so a plan's output needs no merge (merges happen across plans, e.g. ring steps);
- a query segment with a causal diagonal gets its dense keys first, in row order, and its
  diagonal last: bottom-right causal alignment (query i of Lq sees keys up to i + Lk - Lq) then
  computes dense keys and diagonal in one sequence. Consecutive segments of one sample chain into
  one sequence when each sees exactly what the previous saw plus itself (text, image, text of a
  sample at cp = 1 become one sequence, its K/V gathered once);
- segments without a diagonal and with the same keys form one dense sequence.

So a plan is one causal call and at most one dense call (`VarlenCall`), whatever the number of
samples or images. Packing gathers Q and K/V into [total, heads, head_dim] (each query once per
plan; a key as often as dense sequences share it). Invariants of a `VarlenCall`: `q_rows/q_slots`
index the plan's [B, Lq] query slots, every slot at most once; `cu_q/cu_k` are int32 prefix sums
of the sequence lengths (no empty sequence); in a causal call Lk >= Lq for every sequence.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

# (rows of the batch, query slots, key slots, causal): one block of a plan (layout.Block)
Block = tuple[slice, slice, slice, bool]
Range = tuple[int, int]


@dataclass(frozen=True)
class Sequence:
    """One variable-length sequence: its query ranges and key ranges (local slot indices, in
    packing order) and whether its mask is bottom-right causal."""

    q: tuple[Range, ...]
    k: tuple[Range, ...]
    causal: bool


@dataclass
class VarlenCall:
    """One kernel call over packed sequences (see the module docstring for the invariants)."""

    causal: bool
    q_rows: torch.Tensor  # [Tq] long
    q_slots: torch.Tensor
    k_rows: torch.Tensor  # [Tk] long
    k_slots: torch.Tensor
    cu_q: torch.Tensor  # [n + 1] int32, on the kernel's device
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    # cu_q / cu_k as host ints: what a loop over the sequences reads (no device sync per call)
    bounds_q: tuple[int, ...]
    bounds_k: tuple[int, ...]

    @property
    def num_sequences(self) -> int:
        return len(self.bounds_q) - 1

    def sequences(self) -> list[tuple[slice, slice]]:
        """(query slice, key slice) of every sequence in the packed tensors."""
        cq, ck = self.bounds_q, self.bounds_k
        return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]

    def lengths(self) -> list[tuple[int, int]]:
        """(Lq, Lk) of every sequence."""
        return [(qs.stop - qs.start, ks.stop - ks.start) for qs, ks in self.sequences()]

    def to(self, device: torch.device) -> VarlenCall:
        move = {
            f: getattr(self, f).to(device)
            for f in ("q_rows", "q_slots", "k_rows", "k_slots", "cu_q", "cu_k")
        }
        return dataclasses.replace(self, **move)


@dataclass
class PackedPlan:
    """A plan as varlen calls: at most one causal and one dense. `lq`, `lk`: the plan's local
    query and key lengths; `rows`: batch rows."""

    calls: tuple[VarlenCall, ...]
    rows: int
    lq: int
    lk: int
    _on: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> tuple[VarlenCall, ...]:
        """The calls with their index tensors on `device` (moved once per device)."""
        if device.type == "cpu":
            return self.calls
        if device not in self._on:
            self._on[device] = tuple(c.to(device) for c in self.calls)
        return self._on[device]


def _merge_runs(ranges: list[Range]) -> tuple[Range, ...]:
    out: list[Range] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return tuple(out)


def _row_sequences(blocks: list[Block], q_order: list[int], k_order: list[int]) -> list[Sequence]:
    """The sequences of one row's blocks. q_order/k_order: row position of each local slot."""
    bounds = sorted({x for _, qs, _, _ in blocks for x in (qs.start, qs.stop)})
    dense: dict[int, list[Range]] = {}  # segment start -> its dense key ranges
    diag: dict[int, Range] = {}
    segment_end = dict(zip(bounds[:-1], bounds[1:]))
    for _, qs, ks, causal in blocks:
        if causal:
            if segment_end[qs.start] != qs.stop:
                raise RuntimeError(f"causal block {qs} is cut by another block's query boundary")
            diag[qs.start] = (ks.start, ks.stop)
        else:
            i = bisect.bisect_left(bounds, qs.start)
            while bounds[i] < qs.stop:
                dense.setdefault(bounds[i], []).append((ks.start, ks.stop))
                i += 1
    out: list[Sequence] = []
    by_keys: dict[tuple[Range, ...], list[Range]] = {}  # dense segments by their key set
    chains: dict[tuple[Range, ...], list] = {}  # open causal chains by the key set they cover
    starts = sorted(set(dense) | set(diag), key=lambda a: q_order[a])
    for a in starts:
        seg = (a, segment_end[a])
        keys = _merge_runs(dense.get(a, []))
        if a not in diag:
            by_keys.setdefault(keys, []).append(seg)
            continue
        chain = chains.pop(keys, None)
        if chain is None:  # dense keys in row order, then the diagonal
            chain = [[], sorted(keys, key=lambda r: k_order[r[0]])]
        chain[0].append(seg)
        chain[1].append(diag[a])
        chains[_merge_runs([*keys, diag[a]])] = chain
    for q_ranges, k_ranges in chains.values():
        out.append(Sequence(tuple(q_ranges), tuple(k_ranges), True))
    for keys, q_ranges in by_keys.items():
        out.append(
            Sequence(tuple(q_ranges), tuple(sorted(keys, key=lambda r: k_order[r[0]])), False)
        )
    return out


def _index(ranges: list[tuple[Range, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated slot indices of each sequence's ranges, and the int32 prefix sums."""
    parts = [torch.arange(a, b) for rs in ranges for a, b in rs]
    lengths = [sum(b - a for a, b in rs) for rs in ranges]
    cu = torch.zeros(len(ranges) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)), cu


def _call(per_row: list[tuple[int, list[Sequence]]], causal: bool) -> VarlenCall | None:
    seqs = [(b, s) for b, row in per_row for s in row if s.causal == causal]
    if not seqs:
        return None
    q_slots, cu_q = _index([s.q for _, s in seqs])
    k_slots, cu_k = _index([s.k for _, s in seqs])
    q_rows = torch.repeat_interleave(
        torch.tensor([b for b, _ in seqs]), (cu_q[1:] - cu_q[:-1]).long()
    )
    k_rows = torch.repeat_interleave(
        torch.tensor([b for b, _ in seqs]), (cu_k[1:] - cu_k[:-1]).long()
    )
    return VarlenCall(
        causal,
        q_rows,
        q_slots,
        k_rows,
        k_slots,
        cu_q,
        cu_k,
        int((cu_q[1:] - cu_q[:-1]).max()),
        int((cu_k[1:] - cu_k[:-1]).max()),
        tuple(cu_q.tolist()),
        tuple(cu_k.tolist()),
    )


def pack(blocks: list[Block], q_order: torch.Tensor, k_order: torch.Tensor) -> PackedPlan:
    """The block plan of query slots with row positions `q_order` [B, Lq] over key slots
    `k_order` [B, Lk] as varlen calls (a causal one first, then a dense one; either may be
    absent). Blocks for all rows (`rows` = slice(None)) are packed once and repeated per row."""
    rows, lq = q_order.shape
    lk = k_order.shape[1]
    by_row: dict[int, list[Block]] = {}
    shared: list[Block] = []  # blocks of every row
    for blk in blocks:
        row = blk[0].start
        if row is None:
            shared.append(blk)
        else:
            by_row.setdefault(row, []).append(blk)
    per_row: list[tuple[int, list[Sequence]]] = []
    if shared:
        seqs = _row_sequences(shared, q_order[0].tolist(), k_order[0].tolist())
        per_row.extend((b, seqs) for b in range(rows))
    for b, row_blocks in sorted(by_row.items()):
        per_row.append((b, _row_sequences(row_blocks, q_order[b].tolist(), k_order[b].tolist())))
    calls = tuple(c for c in (_call(per_row, True), _call(per_row, False)) if c is not None)
    return PackedPlan(calls, rows, lq, lk)


# ----------------------------------------------------------------------------------------------
# The executor


class VarlenKernel:
    """out, lse, aux = forward(q, k, v, call, scale); dq, dk, dv = backward(...).

    q [Tq, H, D], k/v [Tk, Hkv, D] packed (Hkv divides H: query head h uses K/V head
    h // (H / Hkv)); out [Tq, H, D] in q's dtype, lse [H, Tq] float32 (natural log). In a causal
    call query i of a sequence sees its keys up to i + Lk - Lq (bottom-right). backward takes the
    final (merged over plans) out and lse; dk/dv come back with Hkv heads. `launches(call)`: the
    kernel launches one call costs. The kernels of the registry (kernels.KERNELS) implement it
    on their batched block op (kernels.Kernel)."""

    name = "abstract"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: VarlenCall, scale: float
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
        call: VarlenCall,
        scale: float,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def launches(self, call: VarlenCall) -> int:
        raise NotImplementedError


def run_plan(
    kernel: VarlenKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PackedPlan
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> out [B, H, Lq, D] (q's dtype), lse [B, H, Lq]
    (float32, float64 for float64 q), and the calls' auxes. Queries in no sequence (padding, or
    seeing no key of this plan) get out 0 and lse -inf."""
    b, h, lq, d = q.shape
    scale = d**-0.5
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, L, heads, D] views
    out = q.new_zeros(b, lq, h, d)
    lse = q.new_full((b, lq, h), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
    auxes = []
    for call in plan.on(q.device):
        qi, ki = (call.q_rows, call.q_slots), (call.k_rows, call.k_slots)
        o, seq_lse, aux = kernel.forward(qt[qi], kt[ki], vt[ki], call, scale)
        out[qi] = o.to(q.dtype)
        lse[qi] = seq_lse.t()
        auxes.append(aux)
    return out.transpose(1, 2), lse.transpose(1, 2), auxes


def run_plan_backward(
    kernel: VarlenKernel,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: PackedPlan,
    auxes: list,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Backward of `run_plan` with the final out/lse, accumulated into dq/dk/dv (float32
    accumulators shaped as q/k/v)."""
    scale = q.shape[-1] ** -0.5
    qt, kt, vt, dot, ot = (x.transpose(1, 2) for x in (q, k, v, dout, out))
    lt = lse.transpose(1, 2)
    for call, aux in zip(plan.on(q.device), auxes):
        qi, ki = (call.q_rows, call.q_slots), (call.k_rows, call.k_slots)
        dq_, dk_, dv_ = kernel.backward(
            dot[qi], qt[qi], kt[ki], vt[ki], ot[qi], lt[qi].t().contiguous(), call, scale, aux
        )
        dq.transpose(1, 2).index_put_(qi, dq_.to(dq.dtype), accumulate=True)
        dk.transpose(1, 2).index_put_(ki, dk_.to(dk.dtype), accumulate=True)
        dv.transpose(1, 2).index_put_(ki, dv_.to(dv.dtype), accumulate=True)


def float_grads(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32 gradient accumulators shaped as the tensors (float64 for float64 ones)."""
    return tuple(
        torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors
    )


def merge(
    out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact log-sum-exp merge of two partial attentions over disjoint key sets (float32
    out): lse = log(e^lse + e^lse_p); out = e^(lse_a - lse) out_a + e^(lse_p - lse) out_p. A query
    that saw no key in either keeps out 0 and lse -inf."""
    new = torch.logaddexp(lse, part_lse)
    seen = new > float("-inf")
    wa = torch.where(seen, torch.exp(lse - new), 0.0).unsqueeze(-1)
    wb = torch.where(seen, torch.exp(part_lse - new), 0.0).unsqueeze(-1)
    return out * wa + part_out.float() * wb, new
