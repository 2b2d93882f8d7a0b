"""Model shapes. `debug` trains in well under a second a step on a CPU; `llava7b` is shaped like
LLaVA-1.5-7B (CLIP ViT-L/14 at 336 px, a 2-layer MLP projector, a Llama-2-7B decoder) and is used
for FLOP and memory accounting (build it on the meta device)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from titan_vlm.config import ConfigError


@dataclass(frozen=True)
class ViTArgs:
    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_dim: int = 256
    norm_eps: float = 1e-5
    act: str = "gelu"  # the MLP's GELU: "gelu" (exact) or "gelu_tanh" (SigLIP's gelu_pytorch_tanh)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class DecoderArgs:
    dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 264
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 65536  # RoPE table length: the longest row the model can see

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class VLMArgs:
    vision: ViTArgs = field(default_factory=ViTArgs)
    decoder: DecoderArgs = field(default_factory=DecoderArgs)
    # How the tokens of one image see each other in the decoder: "causal" (in slot order, like
    # any token) or "bidirectional" (all of them). Text is causal either way (layout.py).
    image_attention: str = "causal"

    @property
    def tokens_per_image(self) -> int:
        """Tokens one image occupies in the decoder's sequence (one per ViT patch)."""
        return self.vision.num_patches


FLAVORS: dict[str, VLMArgs] = {
    "debug": VLMArgs(),
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


def model_args(
    flavor: str, image_attention: str = "causal", hf_vision_path: str = "", hf_text_path: str = ""
) -> VLMArgs:
    """The flavor's architecture with the config's model.image_attention. Flavor "hf": the shapes
    of the Hugging Face checkpoints given as model.hf_vision_path / hf_text_path, read from the
    config.json next to each (hf_weights.hf_flavor)."""
    if image_attention not in IMAGE_ATTENTION:
        raise ConfigError(
            f"model.image_attention must be one of {', '.join(IMAGE_ATTENTION)}, "
            f"got {image_attention!r}"
        )
    if flavor == "hf":
        from titan_vlm.models.hf_weights import hf_flavor

        return replace(hf_flavor(hf_vision_path, hf_text_path), image_attention=image_attention)
    return replace(get_flavor(flavor), image_attention=image_attention)
