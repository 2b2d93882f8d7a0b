"""Block plans: the dense and causal blocks that compute attention of a query slot sequence over
a key slot sequence exactly under the mask rule (`plan`), from their pieces (layout/slots.py),
and the per-batch cache the layouts keep them in (`PlanCache`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_vlm.layout.slots import Piece, Slots, pieces
from titan_vlm.varlen import Block

ALL_ROWS = slice(None)


def _relation(q: Piece, k: Piece, bidirectional_images: bool) -> str | None:
    """How the query piece sees the key piece of the same sample: "dense", "causal" or None."""
    q_end, k_end = q.order + q.stop - q.start, k.order + k.stop - k.start
    same_range = (q.order, q_end) == (k.order, k_end)
    if q.image >= 0 and q.image == k.image:
        if bidirectional_images:  # the whole image, also its pieces after q (a sharded image)
            return "dense"
        if same_range:
            return "causal"
    if k_end <= q.order:
        return "dense"
    if k.order >= q_end:
        return None
    if same_range:
        return "causal"
    raise RuntimeError(
        f"pieces overlap partially (query rows {q.order}..{q_end}, key rows {k.order}..{k_end}): "
        "the slots were not cut at the same boundaries"
    )


def _merge_runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _plan_row(
    qp: list[Piece], kp: list[Piece], rows: slice, bidirectional_images: bool
) -> list[Block]:
    by_doc: dict[int, list[Piece]] = {}
    for p in kp:
        by_doc.setdefault(p.doc, []).append(p)
    causal: list[Block] = []
    dense: dict[tuple[int, int], list[tuple[int, int]]] = {}  # query piece -> key ranges
    for q in qp:
        for k in by_doc.get(q.doc, ()):
            rel = _relation(q, k, bidirectional_images)
            if rel == "causal":
                causal.append((rows, slice(q.start, q.stop), slice(k.start, k.stop), True))
            elif rel == "dense":
                dense.setdefault((q.start, q.stop), []).append((k.start, k.stop))
    # Fewer, larger kernel calls: neighbouring key pieces of one query piece become one block,
    # then neighbouring query pieces with the same key blocks.
    by_keys: dict[tuple[tuple[int, int], ...], list[tuple[int, int]]] = {}
    for q_range, k_ranges in dense.items():
        by_keys.setdefault(tuple(_merge_runs(k_ranges)), []).append(q_range)
    blocks = causal
    for k_runs, q_ranges in by_keys.items():
        for qa, qb in _merge_runs(q_ranges):
            blocks.extend((rows, slice(qa, qb), slice(ka, kb), False) for ka, kb in k_runs)
    return blocks


def plan(q: Slots, k: Slots, bidirectional_images: bool) -> list[Block]:
    """The dense and causal blocks that compute attention of the query slots over the key
    slots exactly under the mask rule. Rows with the same metadata share one plan."""
    if q.same_for_all_rows() and k.same_for_all_rows():
        return _plan_row(pieces(q, 0), pieces(k, 0), ALL_ROWS, bidirectional_images)
    out: list[Block] = []
    for b in range(q.doc.shape[0]):
        out.extend(_plan_row(pieces(q, b), pieces(k, b), slice(b, b + 1), bidirectional_images))
    return out


class PlanCache:
    """The plans of one batch by key, made once. A plain object, not a dict, so that every copy
    of the layout shares it: FSDP's mixed-precision input casting rebuilds dataclasses (and
    dicts) field by field for every block it wraps, which would start each copy empty."""

    def __init__(self) -> None:
        self._made: dict = {}

    def get(self, key: tuple, make: Callable[[], object]) -> Any:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def clear(self) -> None:
        self._made.clear()
