"""The "llava" family's shapes. `debug` trains in well under a second a step on a CPU; `llava7b`
is shaped like LLaVA-1.5-7B (CLIP ViT-L/14 at 336 px, a 2-layer MLP projector, a Llama-2-7B
decoder) and is used for FLOP and memory accounting (build it on the meta device).

The args also express the published Hugging Face families exactly (llava/hf_config.py reads
them from config.json): CLIP and SigLIP towers cut at LLaVA's `vision_feature_layer`, LLaVA's
projector, and Llama / Mistral / Qwen2 / Qwen3 decoders. The defaults are the built-in flavors'
architecture (a SigLIP-like tower, every layer, then its final norm; a bias-free Llama decoder).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.activations import ACTIVATIONS
from titan_vlm.models.common.text_args import DecoderArgs, MoEArgs


@dataclass(frozen=True)
class ViTArgs:
    """The vision tower. Its output is the features the projector takes: `tokens_per_image`
    vectors per image.

    Invariants: the sequence is [class token (class_token)] + one token per patch, with learned
    positions for each; `pre_norm` (CLIP's pre_layrnorm) runs on the embeddings; only `n_layers`
    blocks are built and run (a LLaVA model cut at `vision_feature_layer` has fewer than its source
    tower's `source_layers`); `post_norm` (SigLIP's post_layernorm, the built-in flavors' final
    norm) runs after the last block; `drop_first` then drops position 0 (LLaVA's
    vision_feature_select_strategy "default", whatever the tower)."""

    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    dim: int = 64
    n_layers: int = 2  # blocks built and run
    n_heads: int = 4
    mlp_dim: int = 256
    norm_eps: float = 1e-5
    act: str = "gelu"  # the MLP's activation, one of ACTIVATIONS (SigLIP: gelu_pytorch_tanh)
    patch_bias: bool = True  # the patch convolution's bias (CLIP has none)
    class_token: bool = False  # CLIP's class_embedding, prepended before the positions are added
    pre_norm: bool = False  # CLIP's pre_layrnorm on the embeddings
    post_norm: bool = True  # a final LayerNorm after the last block (LLaVA never applies one)
    drop_first: bool = False  # drop position 0 of the output (vision_feature_select_strategy)
    source_layers: int = 0  # blocks of the source checkpoint's tower; 0: n_layers

    def __post_init__(self) -> None:
        if self.act not in ACTIVATIONS:
            raise ConfigError(
                f"ViT act {self.act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        if self.source_layers == 0:
            object.__setattr__(self, "source_layers", self.n_layers)
        if self.source_layers < self.n_layers:
            raise ConfigError(
                f"ViT n_layers={self.n_layers} is more than source_layers={self.source_layers}"
            )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Rows of the position embedding: the patches and the class token."""
        return self.num_patches + int(self.class_token)

    @property
    def tokens_per_image(self) -> int:
        return self.num_positions - int(self.drop_first)

    def image_tokens(self, height: int, width: int) -> int:
        """Output tokens of an image of height x width pixels (both multiples of patch_size):
        one per patch, plus the class token unless dropped; `tokens_per_image` at image_size."""
        if height % self.patch_size or width % self.patch_size or min(height, width) <= 0:
            raise ValueError(
                f"an image of {height}x{width} pixels is not a whole number of "
                f"{self.patch_size}-pixel patches"
            )
        patches = (height // self.patch_size) * (width // self.patch_size)
        return patches + int(self.class_token) - int(self.drop_first)


@dataclass(frozen=True)
class VLMArgs:
    vision: ViTArgs = field(default_factory=ViTArgs)
    decoder: DecoderArgs = field(default_factory=DecoderArgs)
    # How the tokens of one image see each other in the decoder: "causal" (in slot order, like
    # any token) or "bidirectional" (all of them). Text is causal either way (layout/).
    image_attention: str = "causal"
    # model.attention_kernel: "auto" or a name of kernels.KERNELS; every attention call of the
    # ViT and the decoder passes it (the kernel choice is the model's, not a module global)
    attention_kernel: str = "auto"
    projector_act: str = "gelu"  # between the projector's two linears, one of ACTIVATIONS
    projector_bias: bool = True
    # The token id that stands for one image slot in a Hugging Face model's prompts (LLaVA's
    # image_token_index); None for the built-in flavors, whose data marks image slots itself.
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.projector_act not in ACTIVATIONS:
            raise ConfigError(
                f"projector act {self.projector_act!r} is not supported "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )

    @property
    def tokens_per_image(self) -> int:
        """Tokens one image occupies in the decoder's sequence (the ViT's output positions)."""
        return self.vision.tokens_per_image

    @property
    def image_size(self) -> int:
        """The side of the ViT's native square images (data/__init__.py ImageGeometry)."""
        return self.vision.image_size

    @property
    def patch_size(self) -> int:
        return self.vision.patch_size

    def image_tokens(self, height: int, width: int) -> int:
        """Image slots an image of height x width pixels takes in a row (the data pipeline's
        and the model's one rule): the ViT's output tokens (the projector keeps the count)."""
        return self.vision.image_tokens(height, width)


FLAVORS: dict[str, VLMArgs] = {
    "debug": VLMArgs(),
    # "debug" with a Qwen3-MoE-style decoder: 4 experts, top 2, layers 1 and 2 sparse, 0 dense
    "debug_moe": VLMArgs(decoder=DecoderArgs(qk_norm=True, moe=MoEArgs(ffn_dim=64, layers=(1, 2)))),
    # A slightly larger model for benchmarks on a CPU.
    "small": VLMArgs(
        vision=ViTArgs(image_size=64, patch_size=8, dim=128, n_layers=4, n_heads=4, mlp_dim=512),
        decoder=DecoderArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=768),
    ),
    "llava7b": VLMArgs(
        vision=ViTArgs(
            image_size=336, patch_size=14, dim=1024, n_layers=24, n_heads=16, mlp_dim=4096
        ),
        decoder=DecoderArgs(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=32,
            ffn_dim=11008,
            vocab_size=32000,
            max_seq_len=131072,
        ),
    ),
}


def get_flavor(name: str) -> VLMArgs:
    if name not in FLAVORS:
        raise ConfigError(
            f"model.flavor: unknown flavor {name!r} (known: {', '.join(FLAVORS)}, hf)"
        )
    return FLAVORS[name]


IMAGE_ATTENTION = ("causal", "bidirectional")
