"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU; with the right
DecoderArgs exactly transformers' Llama, Mistral, Qwen2 or Qwen3 (biases, q/k norms, an explicit
head_dim, RoPE scaling, tied embeddings).

It takes the row's image embeddings (already projected to its width) and its text tokens and
runs them as one sequence `[image tokens, text tokens]`; where each local token sits in the row
comes from the `SeqLayout`, so the same code runs unsharded and context-parallel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.attention import SeqLayout, attention
from titan_vlm.models.common.moe import MoE, RouterStats
from titan_vlm.models.common.text_args import DecoderArgs, Rope
from titan_vlm.models.loading import Init

# The decoder's weights drawn normal(0.02), and its residual outputs, normal(0.02 / sqrt(2 x
# layers)) (the experts' stacked weights included)
NORMAL_WEIGHTS = (
    "wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "router.weight",
    "experts.w1", "experts.w3",
)  # fmt: skip
RESIDUAL_WEIGHTS = ("wo.weight", "w2.weight", "experts.w2")


class RMSNorm(nn.Module):
    """Normalises the last dim (computed in fp32), then scales by `weight` [dim]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


def inv_frequencies(head_dim: int, theta: float, rope: Rope) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2] (float64), scaled as transformers'
    modeling_rope_utils scales them for rope types "default", "linear" and "llama3"."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(
    head_dim: int, max_len: int, theta: float, rope: Rope
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, head_dim] (fp32, computed in float64) for each position."""
    inv_freq = inv_frequencies(head_dim, theta, rope)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D]; cos/sin [B or 1, 1, L, D] gathered at each token's row position."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention. Biases: `qkv_bias` on wq/wk/wv, `o_bias` on wo. `qk_norm`: an
    RMSNorm over head_dim (one weight shared by the heads, q_norm / k_norm) on every query and key
    head before RoPE (Qwen3)."""

    def __init__(self, a: DecoderArgs, attention_kernel: str):
        super().__init__()
        self.attention_kernel = attention_kernel  # model.attention_kernel
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=a.o_bias)
        self.qk_norm = a.qk_norm
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: SeqLayout
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, -1, self.head_dim)
        k = self.wk(x).view(b, n, -1, self.head_dim)
        v = self.wv(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, layout, self.attention_kernel)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, a: DecoderArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=a.mlp_bias)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=a.mlp_bias)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=a.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    def __init__(self, a: DecoderArgs, attention_kernel: str):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a, attention_kernel)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: SeqLayout
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, layout)
        return x + self.feed_forward(self.ffn_norm(x))


class MoEBlock(nn.Module):
    """A decoder block whose feed-forward is the mixture of experts (moe.py): it also takes each
    slot's token share (SeqLayout.token_shares) and returns its router statistics [2, E]."""

    def __init__(self, a: DecoderArgs, attention_kernel: str):
        super().__init__()
        assert a.moe is not None
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a, attention_kernel)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.moe = MoE(a.dim, a.moe)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: SeqLayout,
        shares: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x), cos, sin, layout)
        out, stats = self.moe(self.ffn_norm(x), shares)
        return x + out, stats


class Decoder(nn.Module):
    """tok_embeddings -> blocks -> norm -> output. With `tie_embeddings` the output head's weight
    IS the embedding table (one Parameter: named_parameters lists it once, as
    tok_embeddings.weight, and training keeps the two equal)."""

    rope_cos: torch.Tensor  # [max_seq_len, head_dim // 2] buffers, not saved: rebuilt from args
    rope_sin: torch.Tensor

    def __init__(self, a: DecoderArgs, attention_kernel: str):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(
            (MoEBlock if i in a.sparse else DecoderBlock)(a, attention_kernel)
            for i in range(a.n_layers)
        )
        # the router statistics of the last forward (None: a dense decoder), until taken:
        # what the training step's load-balancing loss reads (moe.py aux_loss)
        self.router_stats: RouterStats | None = None
        self.norm = RMSNorm(a.dim, a.norm_eps)
        if a.tie_embeddings:
            self.output = nn.Linear(a.dim, a.vocab_size, bias=False, device="meta")
            self.tie_weights()
        else:
            self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self._init_rope()
        self._init_own_weights()

    def tie_weights(self) -> None:
        """With tie_embeddings, make the output head's weight the embedding's Parameter again.
        Anything that replaces parameters module by module (`to_empty`, `to` across devices)
        gives the two modules separate copies: call this after it (init_weights does). On a
        pipeline's last stage (parallel/pipeline.py StagePlan.prune) the head owns the weight
        and `tok_embeddings`, an empty module there, holds it under the embedding's name; off
        it, one of the two is gone and there is nothing to tie."""
        if not self.args.tie_embeddings or self.output is None or self.tok_embeddings is None:
            return
        if isinstance(self.tok_embeddings, nn.Embedding):
            self.output.weight = self.tok_embeddings.weight
        else:
            self.tok_embeddings.weight = self.output.weight

    def _init_rope(self) -> None:
        a = self.args
        cos, sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, a.rope)
        device = self.rope_cos.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    @torch.no_grad()
    def _init_own_weights(self) -> None:
        """The decoder's initialisation over the modules' defaults: normal weights, residual
        projections scaled by depth, zero biases."""
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        out_std = 0.02 / (2 * self.args.n_layers) ** 0.5  # residual projections scaled by depth
        for name, p in self.named_parameters():
            if name.endswith(NORMAL_WEIGHTS):
                nn.init.normal_(p, std=0.02)
            elif name.endswith(RESIDUAL_WEIGHTS):
                nn.init.normal_(p, std=out_std)
            elif name.startswith("layers.") and name.endswith(".bias"):
                nn.init.zeros_(p)
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, std=self.args.dim**-0.5)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter and the RoPE tables in place, drawing from the random
        generator in the order construction does: after the same seed, a model built on the meta
        device and materialised (to_empty) gets the weights a model built on the CPU has. Ties the
        embeddings again first (to_empty untied them)."""
        self.tie_weights()
        for m in self.modules():
            if m is self.output and self.args.tie_embeddings:
                continue  # the embedding's weight: construction drew nothing for it here
            if isinstance(m, (nn.Embedding, nn.Linear, RMSNorm)):
                m.reset_parameters()
        self._init_rope()
        self._init_own_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        image_embeds: torch.Tensor | None,
        layout: SeqLayout,
        inline_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] (the local text section), image_embeds [B, N, dim] or None -> logits
        [B, T, vocab] of the text section.

        The local sequence is `[image tokens, text section]`; `layout.positions` gives each slot
        its row position (RoPE and the causal order). `inline_embeds` [M, dim]: the embeddings
        of image slots inside the text section (a CP rank's samples kept whole,
        SeqLayout.inline_embeds), which replace those slots' token embeddings; their logits
        carry no label."""
        h, n_img = self.local_sequence(tokens, image_embeds, layout, inline_embeds)
        h = self.run_layers(h, layout)
        return self.output(self.norm(h[:, n_img:]))

    def run_layers(
        self,
        h: torch.Tensor,
        layout: SeqLayout,
        after: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        layers: range | None = None,
    ) -> torch.Tensor:
        """The blocks on h [B, L, dim] (`layers`: those blocks only, a pipeline stage's; None:
        all), with `after(i, h)` applied after block i (a family's additions between layers,
        e.g. DeepStack); keeps the sparse layers' router statistics in `router_stats`."""
        cos, sin = self.rotary(layout)
        shares = layout.token_shares() if self.args.moe else None
        stats = []
        for i in layers if layers is not None else range(len(self.layers)):
            layer = self.layers[i]
            if shares is not None and i in self.args.sparse:
                h, layer_stats = layer(h, cos, sin, layout, shares)
                stats.append(layer_stats)
            else:
                h = layer(h, cos, sin, layout)
            if after is not None:
                h = after(i, h)
        # MoEArgs has a sparse layer, but a pipeline stage's `layers` may hold none
        if self.args.moe is not None and stats:
            self.router_stats = RouterStats(torch.stack(stats), self.args.moe)
        return h

    def take_router_stats(self) -> RouterStats | None:
        """The last forward's router statistics, once (they hold the forward's graph)."""
        stats, self.router_stats = self.router_stats, None
        return stats

    def local_sequence(
        self,
        tokens: torch.Tensor,
        image_embeds: torch.Tensor | None,
        layout: SeqLayout,
        inline_embeds: torch.Tensor | None,
    ) -> tuple[torch.Tensor, int]:
        """The first block's input [B, N + T, dim], `[image tokens, text section]` with the inline
        image slots' embeddings in place (`forward`), and N."""
        h = self.tok_embeddings(tokens)
        if inline_embeds is not None:
            h = h.index_put(layout.inline_slots(h.device), inline_embeds.to(h.dtype))
        n_img = 0
        if image_embeds is not None:
            n_img = image_embeds.shape[1]
            h = torch.cat([image_embeds.to(h.dtype), h], dim=1)
        if n_img != layout.num_image_tokens:
            raise ValueError(f"layout says {layout.num_image_tokens} image tokens, got {n_img}")
        return h, n_img

    def rotary(self, layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, L, head_dim] of the local slots: RoPE at each slot's position in its
        sample (layout.positions). A family whose rotary positions are its own (M-RoPE) subclasses
        the decoder and overrides this alone."""
        cos = self.rope_cos[layout.positions].unsqueeze(1)
        sin = self.rope_sin[layout.positions].unsqueeze(1)
        return cos, sin


def holds_parameters(block: nn.Module) -> bool:
    """Whether `block` has parameters: a decoder layer of this rank's, not another pipeline
    stage's parameter-free placeholder (parallel/pipeline.py StagePlan.prune)."""
    return any(True for _ in block.parameters())


def decoder_weight_init(d: DecoderArgs, name: str) -> Init:
    """How a weight of the decoder (held as `decoder`; its biases and norms aside) starts from
    scratch in every family: its head at dim^-0.5, its residual outputs (wo, w2) at
    0.02/sqrt(2 * layers), the rest normal(0.02)."""
    if name == "decoder.output.weight":
        return Init("normal", d.dim**-0.5)
    if name.endswith(RESIDUAL_WEIGHTS):
        return Init("normal", 0.02 / math.sqrt(2 * d.n_layers))
    return Init("normal", 0.02)


def after_to_empty(model: nn.Module) -> None:
    """What `Module.to_empty` undoes of a model holding a Decoder as `decoder`: its RoPE tables
    (buffers, left unset) and tied embeddings (to_empty gives the head a copy of its own; FSDP
    then follows the module attribute). Every family's ModelSpec.after_to_empty."""
    decoder = model.get_submodule("decoder")
    assert isinstance(decoder, Decoder)
    decoder._init_rope()
    decoder.tie_weights()
