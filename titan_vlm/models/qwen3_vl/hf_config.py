"""A Qwen3-VL config.json (model_type "qwen3_vl", or "qwen3_vl_moe" for the mixture-of-experts
decoder, as transformers 5 writes them and the hub's Qwen/Qwen3-VL-* folders hold them) ->
Qwen3VLArgs.

    text_config     a Qwen3 text model (model_type "qwen3_vl_text": q/k norms, explicit head_dim;
                    "qwen3_vl_moe_text": with experts, common/hf_config.py moe_args)
                    with rope_parameters {"rope_type": "default", "rope_theta", "mrope_section",
                    "mrope_interleaved"}; transformers' Qwen3-VL always interleaves the sections
                    (mrope.py), so mrope_interleaved is not read
    vision_config   model_type "qwen3_vl_vision" (old files: "qwen3_vl"): depth, widths,
                    num_position_embeddings, deepstack_visual_indexes, patch / merge / temporal
                    sizes, rope_parameters {"rope_type": "axial", "rope_theta"}
    top level       image / video / vision start / end token ids, tie_word_embeddings (the one
                    transformers' Qwen3-VL reads: a text_config's is not)

A key that is absent takes transformers' config-class default (5.25). Whatever the modules
cannot express (dropout, sliding windows, other rope types, a tower whose width is not the
decoder's) is a one-line ConfigError naming the file and the key.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.activations import ACTIVATIONS
from titan_vlm.models.common.hf_config import (
    MOE_VL_DEFAULTS,
    Section,
    model_type_of,
    moe_args,
    text_args,
)
from titan_vlm.models.common.qwen_vl.hf_config import mrope_key, split_mrope
from titan_vlm.models.qwen3_vl.args import Qwen3VisionArgs, Qwen3VLArgs

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# old files named the tower as the model
VISION_TYPES = ("qwen3_vl_vision", "qwen3_vl", "qwen3_vl_moe_vision", "qwen3_vl_moe")
TEXT_TYPES = {"qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}

TOP_DEFAULTS: dict[str, Any] = dict(
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    tie_word_embeddings=False,
)
TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    attention_bias=False,
    attention_dropout=0.0,
    use_sliding_window=False,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
# Qwen3VLMoeTextConfig's (5.25) where they differ, and its experts
MOE_TEXT_DEFAULTS: dict[str, Any] = dict(
    TEXT_DEFAULTS,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=None,  # Qwen3VLMoeTextConfig: hidden_size // num_attention_heads when absent
    **MOE_VL_DEFAULTS,
)
VISION_DEFAULTS: dict[str, Any] = dict(
    depth=27,
    hidden_size=1152,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=3584,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
VISION_ROPE_DEFAULTS: dict[str, Any] = dict(rope_type="axial", rope_theta=10000.0)
DEFAULT_MROPE_SECTION = (24, 20, 20)  # Qwen3VLTextRotaryEmbedding's default


def _int_list(s: Section, name: str) -> tuple[int, ...]:
    value = s.get(name)
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise s.error(name, value, "a list of block indexes is needed")
    return tuple(value)


def _vision_args(s: Section) -> Qwen3VisionArgs:
    model_type_of(s.cfg, s.where, s.prefix, VISION_TYPES, default=VISION_TYPES[0])
    rope = s.cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise s.error("rope_parameters", rope, "an object is needed")
    defaults = dict(VISION_ROPE_DEFAULTS)
    if "rope_theta" in s.cfg:  # a legacy top-level theta, which transformers moves into the dict
        defaults["rope_theta"] = s.get_float("rope_theta")
    r = Section(rope, s.where, s.key("rope_parameters."), defaults)
    r.one_of("rope_type", ("axial", "default"))  # transformers reads "default" as "axial"
    try:  # the args' own checks do not know the file
        return Qwen3VisionArgs(
            depth=s.get_int("depth"),
            hidden_size=s.get_int("hidden_size"),
            num_heads=s.get_int("num_heads"),
            intermediate_size=s.get_int("intermediate_size"),
            hidden_act=s.one_of("hidden_act", ACTIVATIONS),
            patch_size=s.get_int("patch_size"),
            temporal_patch_size=s.get_int("temporal_patch_size"),
            spatial_merge_size=s.get_int("spatial_merge_size"),
            out_hidden_size=s.get_int("out_hidden_size"),
            in_channels=s.get_int("in_channels"),
            num_position_embeddings=s.get_int("num_position_embeddings"),
            deepstack_visual_indexes=_int_list(s, "deepstack_visual_indexes"),
            rope_theta=r.get_float("rope_theta"),
        )
    except ConfigError as e:
        if str(e).startswith(s.where):
            raise
        raise ConfigError(f"{s.where}: vision_config: {e}") from None


def args_from_hf_config(config: dict, where: str) -> Qwen3VLArgs:
    """A Qwen3VLForConditionalGeneration or Qwen3VLMoeForConditionalGeneration config.json
    (parsed; `where` names the file in messages) -> the family's args."""
    model_type = model_type_of(config, where, "", MODEL_TYPES)
    top = Section(config, where, "", TOP_DEFAULTS)
    text_cfg = config.get("text_config")
    if not isinstance(text_cfg, dict):
        raise ConfigError(f"{where}: text_config is missing or not an object")
    sparse = model_type == "qwen3_vl_moe"
    text = Section(text_cfg, where, "text_config.", MOE_TEXT_DEFAULTS if sparse else TEXT_DEFAULTS)
    text_type = TEXT_TYPES[model_type]
    model_type_of(text.cfg, where, text.prefix, (text_type,), default=text_type)
    text, mrope_section = split_mrope(text, DEFAULT_MROPE_SECTION)
    decoder = text_args(text, "qwen3")
    if sparse:  # Qwen3-VL-MoE's router always renormalises its top-k probabilities
        decoder = replace(decoder, moe=moe_args(text, norm_topk_prob=True))
    if len(mrope_section) != 3 or sum(mrope_section) != decoder.head_dim // 2:
        raise text.error(
            mrope_key(text),
            list(mrope_section),
            f"three sections summing to head_dim / 2 = {decoder.head_dim // 2} are needed",
        )
    tied = top.get_bool("tie_word_embeddings")  # Qwen3VLConfig's; text_config's is not read
    vision_cfg = config.get("vision_config") or {}
    if not isinstance(vision_cfg, dict):
        raise ConfigError(f"{where}: vision_config is not an object")
    vision_section = Section(vision_cfg, where, "vision_config.", VISION_DEFAULTS)
    vision = _vision_args(vision_section)
    if vision.out_hidden_size != decoder.dim:
        raise vision_section.error(
            "out_hidden_size", vision.out_hidden_size, f"the text hidden_size is {decoder.dim}"
        )
    if len(vision.deepstack_visual_indexes) > decoder.n_layers:
        raise vision_section.error(
            "deepstack_visual_indexes",
            list(vision.deepstack_visual_indexes),
            f"one feature per decoder layer at most, and the decoder has {decoder.n_layers}",
        )
    return Qwen3VLArgs(
        vision=vision,
        decoder=replace(decoder, tie_embeddings=tied),
        mrope_section=mrope_section,
        image_token_id=top.get_int("image_token_id"),
        video_token_id=top.get_int("video_token_id"),
        vision_start_token_id=top.get_int("vision_start_token_id"),
        vision_end_token_id=top.get_int("vision_end_token_id"),
    )
