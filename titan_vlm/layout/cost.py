"""The CP cost model: what a CP rank's share of a step costs (`LayoutCost`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayoutCost:
    """What a CP rank's share of a step costs, in one unit (model FLOPs of forward and backward,
    or any multiple of them): `slot` per decoder slot the rank holds (the linear layers, norms
    and residuals run on every local slot, padding included), `pair` per attention query-key
    pair its queries compute, `image` per image its ViT encodes (cp_vision). The one cost model
    the auto placement balances and `cp_balance` reports. The default counts attention pairs
    only; the trainer takes the model family's (ModelSpec.layout_cost)."""

    slot: float = 0.0
    pair: float = 1.0
    image: float = 0.0
