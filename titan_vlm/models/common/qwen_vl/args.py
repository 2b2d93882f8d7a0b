"""The "qwen2_5_vl" family's shapes: `VisionArgs` (the vision tower and its patch merger) and
`Qwen25VLArgs` (tower, Qwen2 decoder, multimodal RoPE, the prompt's special token ids).

Pixels enter as transformers' Qwen2.5-VL image processor makes them: an image or video of grid
(t, h, w) is t*h*w patches, each a flat [in_channels * temporal_patch_size * patch_size^2]
vector, the patches of one spatial_merge_size^2 merge unit consecutive. It leaves the tower as
t*h*w / spatial_merge_size^2 embeddings of out_hidden_size (= the decoder's width), one per merge
unit, which fill that many consecutive image (or video) token slots of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.activations import ACTIVATIONS
from titan_vlm.models.common.text_args import DecoderArgs


@dataclass(frozen=True)
class VisionArgs:
    """The vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel).

    Invariants: hidden_size is num_heads whole heads of head_dim, and head_dim is a multiple of
    4 (the 2-D rotary embedding gives head_dim / 4 frequencies to each of h and w, then repeats
    them rotate-half style); a window is window_units x window_units merge units
    (window_size // (spatial_merge_size * patch_size) >= 1); fullatt_block_indexes are blocks
    that exist. `norm_eps` is transformers' fixed 1e-6 of every RMSNorm of the tower (the
    blocks' and the merger's ln_q), `rope_theta` the rotary base of its rope_parameters."""

    depth: int = 4
    hidden_size: int = 32
    num_heads: int = 2
    intermediate_size: int = 64
    hidden_act: str = "silu"  # the blocks' gated MLP; the merger's activation is exact GELU
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 56  # pixels: window_units = window_size // (merge * patch)
    fullatt_block_indexes: tuple[int, ...] = (1, 3)
    out_hidden_size: int = 64
    in_channels: int = 3
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"vision hidden_act {self.hidden_act!r} is not supported "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(
                f"vision hidden_size={self.hidden_size} must be num_heads={self.num_heads} heads "
                "of a head_dim divisible by 4 (the 2-D rotary embedding)"
            )
        if self.window_units < 1:
            raise ConfigError(
                f"vision window_size={self.window_size} is smaller than one merge unit "
                f"({self.spatial_merge_size * self.patch_size} pixels)"
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(
                f"vision fullatt_block_indexes {bad} are not blocks of a depth-{self.depth} tower"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flat patch of pixel_values: C * temporal_patch_size * patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output embedding: spatial_merge_size^2."""
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:
        """Side of an attention window, in merge units (transformers' vit_merger_window_size)."""
        return self.window_size // (self.spatial_merge_size * self.patch_size)

    @property
    def block_weights(self) -> int:
        """Matmul weights a patch meets in one block: the fused qkv, proj and the gated MLP."""
        h = self.hidden_size
        return 4 * h * h + 3 * h * self.intermediate_size

    @property
    def mergers(self) -> int:
        """Patch mergers a merge unit goes through (Qwen3-VL adds DeepStack ones)."""
        return 1

    def tokens(self, t: int, h: int, w: int) -> int:
        """Embeddings (image or video token slots) of a grid of t x h x w patches: one per merge
        unit, t * h * w / spatial_merge_size^2 (h and w are multiples of spatial_merge_size)."""
        m = self.spatial_merge_size
        if h % m or w % m or min(t, h, w) <= 0:
            raise ValueError(f"grid ({t}, {h}, {w}) is not whole {m}x{m} merge units")
        return t * h * w // self.merge_unit


@dataclass(frozen=True)
class Qwen25VLArgs:
    """The whole model (transformers' Qwen2_5_VLForConditionalGeneration).

    Invariants: the tower's out_hidden_size is the decoder's width; mrope_section has three
    parts (temporal, height, width) that sum to decoder.head_dim / 2: frequency j of RoPE turns by
    the position of the axis whose section holds j. An image of grid (t, h, w) fills
    vision.tokens(t, h, w) consecutive `image_token_id` slots of its row (a video:
    `video_token_id` slots), usually between vision_start and vision_end tokens; a video's
    temporal positions advance by tokens_per_second * its seconds per temporal patch."""

    vision: VisionArgs = field(default_factory=VisionArgs)
    decoder: DecoderArgs = field(
        default_factory=lambda: DecoderArgs(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=300, qkv_bias=True
        )
    )
    mrope_section: tuple[int, ...] = (2, 3, 3)
    image_token_id: int = 290
    video_token_id: int = 291
    vision_start_token_id: int = 292
    vision_end_token_id: int = 293
    tokens_per_second: float = 4.0
    # model.attention_kernel: "auto" or a name of kernels.KERNELS, for the tower and the decoder
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.decoder.head_dim // 2:
            raise ConfigError(
                f"mrope_section {list(self.mrope_section)} must be three parts summing to "
                f"head_dim / 2 = {self.decoder.head_dim // 2}"
            )
        if self.vision.out_hidden_size != self.decoder.dim:
            raise ConfigError(
                f"vision out_hidden_size={self.vision.out_hidden_size} is not the decoder's "
                f"hidden_size={self.decoder.dim}"
            )
        ids = (self.image_token_id, self.video_token_id)
        if ids[0] == ids[1]:
            raise ConfigError(f"image_token_id and video_token_id are both {ids[0]}")

    # What the data pipeline needs of a family's args (data/__init__.py ImageGeometry): the
    # built-in synthetic images are squares of one attention window (at least one merge unit).
    @property
    def patch_size(self) -> int:
        return self.vision.patch_size

    @property
    def image_size(self) -> int:
        """The side of the synthetic data's square images: one attention window."""
        unit = self.vision.patch_size * self.vision.spatial_merge_size
        return unit * self.vision.window_units

    @property
    def tokens_per_image(self) -> int:
        """Slots of an image of `image_size`."""
        return self.image_tokens(self.image_size, self.image_size)

    def image_tokens(self, height: int, width: int) -> int:
        """Slots of an image of height x width pixels (multiples of patch * merge)."""
        p = self.vision.patch_size
        return self.vision.tokens(1, height // p, width // p)
