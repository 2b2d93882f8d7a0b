"""The mixture-of-experts feed-forward of a decoder layer (transformers' Qwen3-MoE sparse block),
dropless, and its router's load-balancing loss over the global batch.

    x [B, L, dim] --router--> probs [B*L, E] (softmax in fp32) --top_k--> k experts per token
    (their probabilities renormalised to sum to 1 with norm_topk_prob)
    tokens sorted by expert (stable) --each expert's SwiGLU on its own tokens--> [B*L*k, dim]
    x the token's probability for that expert --summed per token--> [B, L, dim]

No token is dropped for capacity: every layout computes what one process computes.

Router statistics (`MoE.forward`'s second output, one [2, E] per sparse layer): row 0 the number
of top-k picks of each expert, row 1 the sum of each expert's router probability, over this
rank's tokens, each token weighted 1 / `SeqLayout.token_shares` (1 for a token this rank owns,
1/cp for an image-prefix token every CP rank holds, 0 for padding), so that their sum over the
dp x cp ranks counts each token of the global batch exactly once. `aux_loss` turns them into
transformers' load_balancing_loss_func over the whole global batch (one all-reduce of the
counts), and its share on this rank, whose gradient is this rank's part of the global one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_vlm.distributed import dist_sum, local_tensor
from titan_vlm.models.common.grouped import experts
from titan_vlm.models.common.text_args import MoEArgs
from titan_vlm.parallel.expert_parallel import ep_experts


class Experts(nn.Module):
    """`num_experts` SwiGLUs held as stacked weights (what expert parallelism shards along dim 0):
    w1 (gate) and w3 (up) [E, ffn_dim, dim], w2 (down) [E, dim, ffn_dim]."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, kernel: str = "auto"):
        super().__init__()
        self.kernel = kernel  # how the matmuls run (models/common/grouped.py KERNEL_NAMES)
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        # expert parallelism (parallel/expert_parallel.py apply_ep): the name of the process
        # group whose ranks each hold E / ep of the experts (w1, w3, w2 DTensors sharded along
        # dim 0 over it); None: every expert here
        self.ep_group: str | None = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim], its rows grouped by expert (counts [E]: rows of expert e, in order) ->
        each row through its expert [N, dim]: the `titan_vlm::experts` op here, or with expert
        parallelism `titan_vlm::ep_experts` (the rows travel to their experts' ranks and back)."""
        w1, w3, w2 = (local_tensor(w) for w in (self.w1, self.w3, self.w2))
        if self.ep_group is None:
            return experts(x, counts, w1, w3, w2, self.kernel)
        return ep_experts(x, counts, w1, w3, w2, self.ep_group, self.kernel)


class MoE(nn.Module):
    """The sparse feed-forward (module docstring): `router` [E, dim] and `experts`."""

    def __init__(self, dim: int, m: MoEArgs):
        super().__init__()
        self.args = m
        self.router = nn.Linear(dim, m.num_experts, bias=False)
        self.experts = Experts(m.num_experts, dim, m.ffn_dim, m.kernel)

    def forward(self, x: torch.Tensor, shares: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, dim], shares [B, L] (of how many ranks' slots each slot's token is one:
        SeqLayout.token_shares; 0 padding) -> the output [B, L, dim] and the router statistics
        [2, E] (module docstring), each slot weighted 1 / share."""
        m = self.args
        b, n, dim = x.shape
        flat = x.reshape(-1, dim)
        logits = self.router(flat)  # [T, E]
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        top_p, top_e = probs.topk(m.top_k, dim=-1)  # [T, k]
        if m.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        chosen = top_e.flatten()  # [T * k]: token t's picks at t * k ... t * k + k - 1
        order = chosen.argsort(stable=True)
        token = order // m.top_k  # the token of each sorted pick
        # rows per expert, of a static size (bincount's depends on the data)
        counts = torch.zeros(m.num_experts, dtype=torch.long, device=x.device)
        counts = counts.index_add(0, chosen, torch.ones_like(chosen))
        picked = self.experts(flat[token], counts)
        picked = picked * top_p.to(x.dtype).flatten()[order, None]
        out = torch.zeros_like(flat).index_add(0, token, picked)
        share = shares.reshape(-1).to(torch.float32)
        w = torch.where(share > 0, 1 / share.clamp(min=1), 0.0)
        hits = torch.zeros(m.num_experts, device=x.device).index_add(
            0, chosen, w.repeat_interleave(m.top_k)
        )
        stats = torch.stack([hits, (probs * w[:, None]).sum(dim=0)])
        return out.view(b, n, dim), stats


@dataclass(frozen=True)
class RouterStats:
    """One forward's router statistics: [sparse layers, 2, E] (module docstring) and the
    experts' args."""

    stats: torch.Tensor
    args: MoEArgs


def aux_loss(
    router: RouterStats, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's load-balancing loss of one forward over the ranks of `group` (dp x cp: each
    token of the global batch counted once), as transformers' load_balancing_loss_func computes
    it over a batch and every sparse layer:

        aux = E * sum_e (C_e / N) * (P_e / N)

    C_e: top-k picks of expert e summed over the layers; P_e: its router probabilities summed
    the same way; N: tokens x sparse layers. `router` is this rank's (`MoE.forward`'s, stacked).
    Returns `aux_loss_coef` x this rank's share of aux (global C and N, its own P: the shares
    sum over the group to coef x aux, and each one's gradient is this rank's part of aux's), aux
    itself (detached, the same on every rank) and the global per-layer counts [layers, E] (the
    expert load). `group` None: this process holds the whole batch."""
    stats = router.stats
    return balance_loss(stats[:, 1].sum(dim=0), stats[:, 0].detach(), router.args, group)


def balance_loss(
    probs: torch.Tensor, counts: torch.Tensor, m: MoEArgs, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`aux_loss` of P (`probs` [E]: each expert's router probabilities summed over this rank's
    tokens and the sparse layers, with their graph) and this rank's picks `counts` [layers, E]
    (detached): what a pipeline's last stage computes from the statistics every stage added
    (parallel/pipeline.py). Returns aux_loss's three."""
    counts = _sum(counts.clone(), group)  # [layers, E]
    total = counts.sum() / m.top_k  # N: each token's picks count k times
    c = counts.sum(dim=0)
    share = m.num_experts * (c * probs).sum() / total.clamp(min=1) ** 2
    aux = _sum(share.detach().clone(), group)
    return m.aux_loss_coef * share, aux, counts


def _sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else dist_sum(x, group)
