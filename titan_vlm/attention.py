"""The one attention entry point of titan_vlm.

Model code calls `attention(q, k, v, layout)` and knows nothing about parallelism. The
`SeqLayout` it passes along was built outside the model (by the data pipeline or by
`parallel/context_parallel.py`) and says where each local token sits in its row; when the row's
text is sharded over a context-parallel group, `layout.cp` carries the algorithm that makes the
attention exact across ranks.

Mask rule (decoder): a query at row position p sees every key at position <= p. The image
tokens of a row come first, so every text query sees the whole image prefix and the image
queries see only image keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class CPAttention(Protocol):
    """A context-parallel attention algorithm (see parallel/context_parallel.py)."""

    all_positions: torch.Tensor  # [1 or B, N + T]: row positions of every key the group holds

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout) -> torch.Tensor: ...


@dataclass
class SeqLayout:
    """Where the local tokens of each row sit in the (unsharded) row.

    positions: [1 or B, L] row position of each local token: the order key of the causal mask and
        the RoPE position. The first `num_image_tokens` local tokens are the row's image tokens
        (whole on every CP rank); the rest is this rank's text.
    causal_arange: positions are 0..L-1 in order (no sharding), so plain causal attention applies.
    cp: set when the text is sharded over a CP group.
    """

    positions: torch.Tensor
    num_image_tokens: int
    causal_arange: bool = False
    cp: CPAttention | None = None

    @classmethod
    def unsharded(cls, seq_len: int, num_image_tokens: int, device: torch.device | str = "cpu") -> SeqLayout:
        positions = torch.arange(seq_len, device=device).unsqueeze(0)
        return cls(positions=positions, num_image_tokens=num_image_tokens, causal_arange=True)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[B, 1, Lq, Lk] bool mask, True where the key is visible: key position <= query position."""
    return (k_pos[:, None, None, :] <= q_pos[:, None, :, None])


def expand_kv_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Grouped-query attention: repeat each K/V head for the query heads that share it."""
    n_kv = x.shape[1]
    return x if n_kv == n_heads else x.repeat_interleave(n_heads // n_kv, dim=1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         is_causal: bool = False) -> torch.Tensor:
    """The block kernel: q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> [B, H, Lq, D]."""
    k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout | None) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, Hkv, L, D] for the local tokens. layout=None: bidirectional (ViT)."""
    if layout is None:
        return sdpa(q, k, v)
    if layout.cp is not None:
        return layout.cp(q, k, v, layout)
    if layout.causal_arange:
        return sdpa(q, k, v, is_causal=True)
    pos = layout.positions
    return sdpa(q, k, v, mask=causal_mask(pos, pos))
