"""Hugging Face config.json -> the "llava" family's VLMArgs, for the folders titan_vlm computes
exactly (the text model's keys: common/hf_config.py).

    args_from_hf_config(config, where)  a LlavaForConditionalGeneration folder (model_type
                                        "llava"): a CLIP or SigLIP tower + a Llama, Mistral, Qwen2
                                        or Qwen3 text model
    vision_args_from_hf(config, where)  a CLIPVisionModel / SiglipVisionModel folder (or a whole
                                        CLIPModel / SiglipModel: its vision tower)
    text_args_from_hf(config, where)    a Llama / Mistral / Qwen2 / Qwen3 ForCausalLM folder
                                        (common/hf_config.py)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.activations import ACTIVATIONS
from titan_vlm.models.common.hf_config import (
    TEXT_DEFAULTS,
    TEXT_TYPES,
    Section,
    model_type_of,
    text_args,
)
from titan_vlm.models.llava.args import ViTArgs, VLMArgs

VISION_TYPES = ("clip_vision_model", "siglip_vision_model")
CONTRASTIVE_TYPES = ("clip", "siglip")  # a whole CLIPModel / SiglipModel: its vision tower
SELECT_STRATEGIES = ("default", "full")

# transformers' config-class defaults (the same in 4.57 and 5.24) for the keys read here.
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
        num_channels=3,
        layer_norm_eps=1e-5,
        hidden_act="quick_gelu",
        attention_dropout=0.0,
    ),
    "siglip_vision_model": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=16,
        num_channels=3,
        layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
        attention_dropout=0.0,
    ),
}
_LLAVA_DEFAULTS: dict[str, Any] = dict(
    vision_feature_layer=-2,
    vision_feature_select_strategy="default",
    projector_hidden_act="gelu",
    multimodal_projector_bias=True,
    image_token_index=32000,
    tie_word_embeddings=False,
)


def _vision(s: Section, model_type: str) -> ViTArgs:
    """The tower as its own model computes it (every layer; `last_hidden_state`: SigLIP applies
    its post_layernorm there, CLIP only to its pooled class token)."""
    dim, heads = s.get_int("hidden_size"), s.get_int("num_attention_heads")
    if dim % heads:
        raise s.error("num_attention_heads", heads, f"it must divide hidden_size={dim}")
    s.zero_dropout()
    clip = model_type == "clip_vision_model"
    return ViTArgs(
        image_size=s.get_int("image_size"),
        patch_size=s.get_int("patch_size"),
        channels=s.get_int("num_channels"),
        dim=dim,
        n_layers=s.get_int("num_hidden_layers"),
        n_heads=heads,
        mlp_dim=s.get_int("intermediate_size"),
        norm_eps=s.get_float("layer_norm_eps"),
        act=s.one_of("hidden_act", ACTIVATIONS),
        patch_bias=not clip,
        class_token=clip,
        pre_norm=clip,
        post_norm=not clip,
    )


def vision_args_from_hf(config: dict, where: str) -> ViTArgs:
    """A CLIPVisionModel / SiglipVisionModel config.json, or a CLIPModel / SiglipModel one (the
    contrastive model: its vision_config), -> the tower's `last_hidden_state`: every layer, every
    position (CLIP's class token included), SigLIP's post_layernorm applied. (LLaVA takes other
    features: args_from_hf_config.)"""
    model_type = model_type_of(config, where, "", (*VISION_TYPES, *CONTRASTIVE_TYPES))
    if model_type in CONTRASTIVE_TYPES:
        vision_cfg = config.get("vision_config") or {}
        v_type = model_type_of(
            vision_cfg, where, "vision_config.", VISION_TYPES, f"{model_type}_vision_model"
        )
        top = Section(config, where, "", {})
        return _vision(top.sub("vision_config", _VISION_DEFAULTS[v_type]), v_type)
    return _vision(Section(config, where, "", _VISION_DEFAULTS[model_type]), model_type)


def args_from_hf_config(config: dict, where: str) -> VLMArgs:
    """A LlavaForConditionalGeneration config.json -> VLMArgs computing what transformers does:
    the tower's `hidden_states[vision_feature_layer]` (only that many layers are built; no post
    norm), position 0 dropped under vision_feature_select_strategy "default", the projector, and
    the text model with `image_token_index` standing for image slots. Tied embeddings: the
    top-level tie_word_embeddings or the text config's (transformers 5 ties on either)."""
    top = Section(config, where, "", _LLAVA_DEFAULTS)
    model_type_of(config, where, "", ("llava",))
    vision_cfg = config.get("vision_config") or {}
    text_cfg = config.get("text_config") or {}
    v_type = model_type_of(vision_cfg, where, "vision_config.", VISION_TYPES, "clip_vision_model")
    t_type = model_type_of(text_cfg, where, "text_config.", TEXT_TYPES, "llama")
    vision = _vision(top.sub("vision_config", _VISION_DEFAULTS[v_type]), v_type)
    # LlavaForConditionalGeneration's loss has no router term, whatever its text model
    decoder = text_args(top.sub("text_config", TEXT_DEFAULTS[t_type]), t_type).with_router_weight(0)

    layer = top.get("vision_feature_layer")
    n = vision.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise top.error("vision_feature_layer", layer, "one int layer")
    if not -(n + 1) <= layer <= n:
        raise top.error("vision_feature_layer", layer, f"the tower has {n} layers")
    strategy = top.one_of("vision_feature_select_strategy", SELECT_STRATEGIES)
    vision = replace(
        vision,
        n_layers=layer % (n + 1),
        source_layers=n,
        post_norm=False,
        drop_first=strategy == "default",
    )
    image_token = _image_token(config, where)
    tie = top.get_bool("tie_word_embeddings") or decoder.tie_embeddings
    return VLMArgs(
        vision=vision,
        decoder=replace(decoder, tie_embeddings=tie),
        projector_act=top.one_of("projector_hidden_act", ACTIVATIONS),
        projector_bias=top.get_bool("multimodal_projector_bias"),
        image_token_id=image_token,
    )


def _image_token(config: dict, where: str) -> int:
    """`image_token_index` (what 4.x and 5.24 write) or `image_token_id` (5.x's attribute name)."""
    values = {config[k] for k in ("image_token_index", "image_token_id") if k in config}
    if len(values) > 1:
        raise ConfigError(
            f"{where}: image_token_index={config['image_token_index']!r} and "
            f"image_token_id={config['image_token_id']!r} disagree"
        )
    value = values.pop() if values else _LLAVA_DEFAULTS["image_token_index"]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: image_token_index={value!r} is not supported (an int)")
    return value
