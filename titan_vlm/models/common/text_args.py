"""The decoder's architecture, shared by every family whose text model is Llama-shaped (LLaVA's
Llama / Mistral / Qwen2 / Qwen3 text models, Qwen2.5-VL's Qwen2): `DecoderArgs` and its RoPE
scaling `Rope`. common/hf_config.py reads them from a config.json; common/decoder.py builds them."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
