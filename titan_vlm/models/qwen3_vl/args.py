"""The "qwen3_vl" family's shapes: `Qwen3VisionArgs` (the tower, its merger and its DeepStack
mergers) and `Qwen3VLArgs` (tower, Qwen3 decoder, interleaved multimodal RoPE, the prompt's
special token ids).

Qwen3-VL keeps Qwen2.5-VL's way of feeding images (native resolution, patches of a merge unit
consecutive, one embedding per merge unit at the prompt's image / video token slots), so these
args extend common/qwen_vl/args.py's and the Qwen-VL data path (common/qwen_vl: images.py
QwenRule, processor.py, mrope.py rope_index for images) reads them unchanged. What differs
is read by this family's own modules: the tower has no windows (every block attends over each
whole frame: `fullatt_block_indexes` is every block, `window_size` is not used), learned
position embeddings interpolated to each image's grid, LayerNorms with biases, a two-matrix
MLP, and DeepStack mergers; the decoder is Qwen3's (q/k norms, explicit head_dim, no biases)
with M-RoPE's frequencies interleaved over the three axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs, VisionArgs
from titan_vlm.models.common.text_args import DecoderArgs


@dataclass(frozen=True)
class Qwen3VisionArgs(VisionArgs):
    """The vision tower (transformers' Qwen3VLVisionModel).

    Invariants (besides VisionArgs'): `num_position_embeddings` is a square, side x side learned
    positions that each image's h x w patch grid resamples bilinearly (corners aligned);
    `deepstack_visual_indexes` are distinct blocks, each followed by a DeepStack merger whose
    output is added to the decoder's hidden states at the image slots after decoder layer j (the
    j-th listed). Every block attends over each whole frame (`fullatt_block_indexes` is set to
    every block; there are no windows)."""

    hidden_act: str = "gelu_pytorch_tanh"
    patch_size: int = 16
    depth: int = 3
    intermediate_size: int = 48
    num_position_embeddings: int = 16
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    window_size: int = 32  # one merge unit: not used (no windows), kept for VisionArgs' checks
    fullatt_block_indexes: tuple[int, ...] = ()  # every block (__post_init__)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fullatt_block_indexes", tuple(range(self.depth)))
        object.__setattr__(self, "window_size", self.patch_size * self.spatial_merge_size)
        super().__post_init__()
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ConfigError(
                f"vision num_position_embeddings={self.num_position_embeddings} is not a square "
                "(a side x side grid of learned positions)"
            )
        ds = self.deepstack_visual_indexes
        if len(set(ds)) != len(ds) or not all(0 <= i < self.depth for i in ds):
            raise ConfigError(
                f"vision deepstack_visual_indexes {list(ds)} must be distinct blocks of a "
                f"depth-{self.depth} tower"
            )

    @property
    def position_side(self) -> int:
        """Side of the learned position grid."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def block_weights(self) -> int:
        """Matmul weights a patch meets in one block: qkv, proj and the two-matrix MLP."""
        h = self.hidden_size
        return 4 * h * h + 2 * h * self.intermediate_size

    @property
    def mergers(self) -> int:
        """Patch mergers a merge unit goes through: the main one and each DeepStack one."""
        return 1 + len(self.deepstack_visual_indexes)


@dataclass(frozen=True)
class Qwen3VLArgs(Qwen25VLArgs):
    """The whole model (transformers' Qwen3VLForConditionalGeneration).

    Invariants (besides Qwen25VLArgs'): the decoder has at least as many layers as the tower has
    DeepStack mergers (feature j is added after decoder layer j); mrope_section's three parts sum
    to head_dim / 2 and frequency j turns by the temporal position except j = 1, 4, 7, ... below
    3 * mrope_section[1] (height) and j = 2, 5, 8, ... below 3 * mrope_section[2] (width):
    transformers' interleaved layout. An image embedding, as encode_images returns it, is the
    main merger's output and then each DeepStack merger's, concatenated: width
    (1 + len(deepstack_visual_indexes)) * decoder.dim (`embed_width`), so that everything that
    moves image embeddings between ranks moves the DeepStack features with them."""

    vision: VisionArgs = field(default_factory=Qwen3VisionArgs)
    decoder: DecoderArgs = field(
        default_factory=lambda: DecoderArgs(
            dim=64,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=96,
            vocab_size=300,
            head_dim=16,
            qk_norm=True,
            norm_eps=1e-6,
        )
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.vision, Qwen3VisionArgs):
            raise TypeError("Qwen3VLArgs.vision must be Qwen3VisionArgs")
        if len(self.vision.deepstack_visual_indexes) > self.decoder.n_layers:
            raise ConfigError(
                f"{len(self.vision.deepstack_visual_indexes)} DeepStack features for a "
                f"{self.decoder.n_layers}-layer decoder (feature j joins after layer j)"
            )

    @property
    def tower(self) -> Qwen3VisionArgs:
        """`vision`, typed as this family's."""
        assert isinstance(self.vision, Qwen3VisionArgs)
        return self.vision

    @property
    def deepstack(self) -> int:
        """DeepStack features per image slot."""
        return len(self.tower.deepstack_visual_indexes)

    @property
    def embed_width(self) -> int:
        """Width of an image embedding as it travels: the main one and each DeepStack feature."""
        return (1 + self.deepstack) * self.decoder.dim

    @property
    def image_size(self) -> int:
        """The side of the built-in data's square images: 2 x 2 merge units."""
        return 2 * self.vision.patch_size * self.vision.spatial_merge_size
