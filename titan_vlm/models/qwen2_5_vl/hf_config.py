"""A Qwen2.5-VL config.json (model_type "qwen2_5_vl") -> Qwen25VLArgs, for the folders titan_vlm
computes exactly.

Both spellings are read:

    transformers 5.x   text keys in `text_config` (rope_parameters {"rope_type": "default",
                       "mrope_section": [...], "rope_theta": ...}), tie_word_embeddings at the top
    transformers 4.x   text keys at the top level (as the hub's Qwen/Qwen2.5-VL-* files),
    / the hub          rope_scaling {"type": "mrope", "mrope_section": [...]}, rope_theta at the top

and `vision_config` in both. A key that is absent takes the value transformers' config class gives
it (its Qwen2.5-VL defaults: rms_norm_eps 1e-5, rope_theta 1e6, mrope_section [16, 24, 24], ...).
The rope type "mrope" is transformers' old name of "default" with sections. Whatever the modules
cannot express (dropout, sliding windows, other rope types, another head_dim) is a ConfigError of
one line naming the file and the key.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.activations import ACTIVATIONS
from titan_vlm.models.common.hf_config import Section, model_type_of, text_args
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs, VisionArgs
from titan_vlm.models.common.qwen_vl.hf_config import mrope_key, split_mrope

MODEL_TYPES = ("qwen2_5_vl",)
# transformers 4.x wrote the tower's model_type as the whole model's
VISION_TYPES = ("qwen2_5_vl_vision", "qwen2_5_vl")
TEXT_TYPES = ("qwen2_5_vl_text", "qwen2_5_vl")
DEFAULT_MROPE_SECTION = (16, 24, 24)  # Qwen2_5_VLRotaryEmbedding's default

# transformers' config-class defaults (5.25) for the keys read here.
TOP_DEFAULTS: dict[str, Any] = dict(
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    tie_word_embeddings=False,
)
TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=152064,
    hidden_size=8192,
    intermediate_size=29568,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    use_sliding_window=False,
    attention_dropout=0.0,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
VISION_DEFAULTS: dict[str, Any] = dict(
    depth=32,
    hidden_size=3584,
    hidden_act="silu",
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    tokens_per_second=4,
    window_size=112,
    out_hidden_size=3584,
    fullatt_block_indexes=[7, 15, 23, 31],
)
VISION_ROPE_DEFAULTS: dict[str, Any] = dict(rope_type="axial", rope_theta=10000.0)


def _text_section(config: dict, where: str) -> Section:
    """The text model's keys: `text_config` (5.x) or the top level (4.x flat files)."""
    if "text_config" not in config or config["text_config"] is None:
        return Section(config, where, "", TEXT_DEFAULTS)
    if not isinstance(config["text_config"], dict):
        raise ConfigError(f"{where}: text_config is not an object")
    s = Section(config["text_config"], where, "text_config.", TEXT_DEFAULTS)
    model_type_of(s.cfg, where, s.prefix, TEXT_TYPES, default=TEXT_TYPES[0])
    return s


def _vision_args(s: Section) -> tuple[VisionArgs, float]:
    """The tower's args and tokens_per_second (a key of vision_config)."""
    model_type_of(s.cfg, s.where, s.prefix, VISION_TYPES, default=VISION_TYPES[0])
    rope = s.cfg.get("rope_parameters")
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise s.error("rope_parameters", rope, "an object is needed")
    r = Section(rope, s.where, s.key("rope_parameters."), VISION_ROPE_DEFAULTS)
    r.one_of("rope_type", ("axial",))
    full = s.get("fullatt_block_indexes")
    if not isinstance(full, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in full
    ):
        raise s.error("fullatt_block_indexes", full, "a list of block indexes is needed")
    try:  # VisionArgs' own checks do not know the file
        args = VisionArgs(
            depth=s.get_int("depth"),
            hidden_size=s.get_int("hidden_size"),
            num_heads=s.get_int("num_heads"),
            intermediate_size=s.get_int("intermediate_size"),
            hidden_act=s.one_of("hidden_act", ACTIVATIONS),
            patch_size=s.get_int("patch_size"),
            temporal_patch_size=s.get_int("temporal_patch_size"),
            spatial_merge_size=s.get_int("spatial_merge_size"),
            window_size=s.get_int("window_size"),
            fullatt_block_indexes=tuple(full),
            out_hidden_size=s.get_int("out_hidden_size"),
            in_channels=s.get_int("in_channels"),
            rope_theta=r.get_float("rope_theta"),
        )
    except ConfigError as e:
        if str(e).startswith(s.where):
            raise
        raise ConfigError(f"{s.where}: vision_config: {e}") from None
    return args, s.get_float("tokens_per_second")


def args_from_hf_config(config: dict, where: str) -> Qwen25VLArgs:
    """A Qwen2_5_VLForConditionalGeneration config.json (parsed; `where` names the file in
    messages) -> the family's args."""
    model_type_of(config, where, "", MODEL_TYPES)
    top = Section(config, where, "", TOP_DEFAULTS)
    text, mrope_section = split_mrope(_text_section(config, where), DEFAULT_MROPE_SECTION)
    hidden, heads = text.get_int("hidden_size"), text.get_int("num_attention_heads")
    if text.get("head_dim") not in (None, hidden // heads):
        # Qwen2_5_VLAttention always uses hidden_size // num_attention_heads
        raise text.error("head_dim", text.get("head_dim"), f"only {hidden // heads} is")
    decoder = text_args(text, "qwen2")
    if len(mrope_section) != 3 or sum(mrope_section) != decoder.head_dim // 2:
        raise text.error(
            mrope_key(text),
            list(mrope_section),
            f"three sections summing to head_dim / 2 = {decoder.head_dim // 2} are needed",
        )
    # transformers 5 ties at the top level; a text_config's true (4.x saves) ties as well
    tied = top.get_bool("tie_word_embeddings") or text.get_bool("tie_word_embeddings")
    vision_cfg = config.get("vision_config") or {}
    if not isinstance(vision_cfg, dict):
        raise ConfigError(f"{where}: vision_config is not an object")
    vision_section = Section(vision_cfg, where, "vision_config.", VISION_DEFAULTS)
    vision, tokens_per_second = _vision_args(vision_section)
    if vision.out_hidden_size != decoder.dim:
        raise vision_section.error(
            "out_hidden_size", vision.out_hidden_size, f"the text hidden_size is {decoder.dim}"
        )
    return Qwen25VLArgs(
        vision=vision,
        decoder=replace(decoder, tie_embeddings=tied),
        mrope_section=mrope_section,
        image_token_id=top.get_int("image_token_id"),
        video_token_id=top.get_int("video_token_id"),
        vision_start_token_id=top.get_int("vision_start_token_id"),
        vision_end_token_id=top.get_int("vision_end_token_id"),
        tokens_per_second=tokens_per_second,
    )
