"""The decoder's architecture, shared by every family whose text model is Llama-shaped
(LLaVA's Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE text models, Qwen2.5-VL's Qwen2,
Qwen3-VL's): `DecoderArgs`, its RoPE scaling `Rope` and its mixture-of-experts layers
`MoEArgs`. common/hf_config.py reads them from a config.json; common/decoder.py builds them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titan_vlm.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """RoPE frequency scaling as transformers computes it (modeling_rope_utils): "default" (none),
    "linear" (inv_freq / factor) or "llama3" (Llama 3.1's smooth by-wavelength scaling, which uses
    the other three fields)."""

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ConfigError(
                f"rope type {self.type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )


@dataclass(frozen=True)
class MoEArgs:
    """The mixture-of-experts feed-forward of some decoder layers (transformers' Qwen3-MoE
    sparse block): a router (dim -> num_experts, no bias), each token's `top_k` experts by
    softmax probability (renormalised to sum to 1 with `norm_topk_prob`), each expert a SwiGLU
    of width `ffn_dim`, the token's output the probability-weighted sum of its experts'. Dropless:
    every token reaches its top_k experts, whatever their load.

    `layers`: which decoder layers are sparse (the others keep the dense FeedForward of
    DecoderArgs.ffn_dim): transformers' rule, layer i unless i is in mlp_only_layers, when
    (i + 1) % decoder_sparse_step == 0 (`sparse_layers`). `aux_loss_coef`: the weight of the
    router's load-balancing loss in the training loss (models/common/moe.py aux_loss).
    `kernel`: how the experts' matmuls run (model.experts_kernel: models/common/grouped.py
    KERNEL_NAMES), not part of the architecture (a folder's args and a flavor's compare equal
    without it)."""

    num_experts: int = 4
    top_k: int = 2
    ffn_dim: int = 32
    norm_topk_prob: bool = True
    layers: tuple[int, ...] = (0, 1, 2)
    aux_loss_coef: float = 0.001
    kernel: str = field(default="auto", compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("a mixture of experts in no layer: the decoder is dense (moe None)")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.top_k} must be between 1 and "
                f"num_experts={self.num_experts}"
            )


def sparse_layers(n_layers: int, sparse_step: int, mlp_only: tuple[int, ...]) -> tuple[int, ...]:
    """The decoder layers transformers' Qwen3-MoE makes sparse: i not in mlp_only_layers with
    (i + 1) % decoder_sparse_step == 0."""
    return tuple(i for i in range(n_layers) if i not in mlp_only and (i + 1) % sparse_step == 0)


@dataclass(frozen=True)
class DecoderArgs:
    """A Llama-style decoder (RMSNorm, RoPE in the rotate-half layout, grouped-query attention,
    SwiGLU). Qwen2 is `qkv_bias`, Qwen3 `qk_norm` (RMSNorm over head_dim on every query and key
    head before RoPE), Llama's attention_bias is `qkv_bias` and `o_bias`.

    `head_dim` left at 0 becomes dim // n_heads at construction (replace() keeps the resolved
    value: give head_dim again when changing dim or n_heads)."""

    dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 264
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 65536  # RoPE table length: the longest row the model can see
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False  # on w1, w2 and w3
    qk_norm: bool = False
    rope: Rope = field(default_factory=Rope)
    tie_embeddings: bool = False  # the output head is the embedding table (one Parameter)
    moe: MoEArgs | None = None  # None: every layer's feed-forward is dense

    @property
    def token_matmul_params(self) -> int:
        """Matmul weights one token meets going through every layer (FLOPs: 2 per weight): the
        attention's projections, and each layer's dense SwiGLU (3 x dim x ffn_dim) or, in a
        sparse layer, the router (dim x E) and its top_k experts' SwiGLUs: the active ones."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * q + 2 * self.dim * kv
        dense = 3 * self.dim * self.ffn_dim
        sparse = 0
        if self.moe:
            sparse = (
                self.dim * self.moe.num_experts + self.moe.top_k * 3 * self.dim * self.moe.ffn_dim
            )
        n_sparse = len(self.sparse)
        return self.n_layers * attention + (self.n_layers - n_sparse) * dense + n_sparse * sparse

    def with_router_weight(self, coef: float) -> DecoderArgs:
        """These args with the router's load-balancing loss weighted `coef` (unchanged without
        experts)."""
        if self.moe is None:
            return self
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, aux_loss_coef=coef))

    def with_experts_kernel(self, kernel: str) -> DecoderArgs:
        """These args with the experts' matmuls by `kernel` (unchanged without experts)."""
        if self.moe is None:
            return self
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, kernel=kernel))

    @property
    def sparse(self) -> frozenset[int]:
        """The layers whose feed-forward is the mixture of experts (none without `moe`)."""
        return frozenset(self.moe.layers) if self.moe else frozenset()

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.moe and not all(0 <= i < self.n_layers for i in self.moe.layers):
            raise ConfigError(
                f"MoE layers {list(self.moe.layers)} are not all layers of a "
                f"{self.n_layers}-layer decoder"
            )
