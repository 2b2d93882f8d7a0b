"""Hugging Face tensor names <-> titan_vlm parameter names, both directions. Pure functions of the
model args and the names in the files: no tensors, no IO (the loader reads the slices itself).

Every parameter has the shape of its Hugging Face tensor (the ViT's pos_embed is the
[positions, dim] position_embedding table, the class token the [dim] class_embedding), so loading
is a rename and a rank's slice of a file tensor is the same slice of the parameter. No exception.

Key styles, resolved from the names present (`key_style`), one prefix per part:

    LLaVA, transformers 5 save_pretrained   vision_tower.*            multi_modal_projector.*
                                            language_model.model.*    language_model.lm_head.weight
    LLaVA, transformers 4.x / the hub       vision_tower.vision_model.*  (the rest as above)
    LLaVA, in-memory 5.x names              model.vision_tower.*, model.multi_modal_projector.*,
                                            model.language_model.*, lm_head.weight
    CLIPVisionModel / SiglipVisionModel     5.x: embeddings.*, encoder.* ... (no prefix);
                                            4.x: vision_model.*
    CLIPModel / SiglipModel                 vision_model.* (text_model.*, the projections and
                                            logit_scale / logit_bias unused)
    Llama / Mistral / Qwen2 / Qwen3         model.*, lm_head.weight

Tensors the model knowingly does not use (`unused_hf_tensors`): the tower's layers past LLaVA's
vision_feature_layer, a post_layernorm the model does not apply (LLaVA never does; CLIP applies it
to the pooled class token only), SigLIP's pooling head `head.*`, position_ids and rotary inv_freq
buffers of old files, and lm_head when the embeddings are tied (the head IS embed_tokens: our one
parameter maps to embed_tokens, and an export writes no lm_head). Any other tensor in the files
that no parameter takes is an error (`hf_names`).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_vlm.config import ConfigError
from titan_vlm.models.common.hf_adapter import check_file_coverage, decoder_hf_names
from titan_vlm.models.llava.args import VLMArgs


@dataclass(frozen=True)
class KeyStyle:
    """Where each part's tensors live in a file: a name prefix per part (None: the part is not in
    files of this style). `head` is the output head's full name."""

    name: str
    vision: str | None = None
    projector: str | None = None
    text: str | None = None
    head: str | None = None


LLAVA_HF5 = KeyStyle(
    "llava (transformers 5)",
    "vision_tower.",
    "multi_modal_projector.",
    "language_model.model.",
    "language_model.lm_head.weight",
)
LLAVA_HF4 = KeyStyle(
    "llava (transformers 4)",
    "vision_tower.vision_model.",
    "multi_modal_projector.",
    "language_model.model.",
    "language_model.lm_head.weight",
)
LLAVA_MODEL = KeyStyle(
    "llava (in-memory names)",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.language_model.",
    "lm_head.weight",
)
VISION_HF5 = KeyStyle("vision tower (transformers 5)", vision="")
VISION_HF4 = KeyStyle(
    "vision tower (vision_model.*: transformers 4, CLIPModel)", vision="vision_model."
)
# A whole CLIPModel / SiglipModel folder: what is not its vision tower.
_CONTRASTIVE_REST = (
    "text_model.",
    "logit_scale",
    "logit_bias",
    "visual_projection.",
    "text_projection.",
)
CAUSAL_LM = KeyStyle("causal LM", text="model.", head="lm_head.weight")
STYLES = (LLAVA_HF5, LLAVA_HF4, LLAVA_MODEL, VISION_HF5, VISION_HF4, CAUSAL_LM)

# A tensor that every file holding a part has: which prefixes are present.
_PROBES = {
    "vision": "embeddings.patch_embedding.weight",
    "projector": "linear_1.weight",
    "text": "embed_tokens.weight",
}


def key_style(file_keys: set[str], where: str = "the safetensors files") -> KeyStyle:
    """The style whose parts are exactly the parts present in `file_keys`."""
    present = {
        part: {
            getattr(s, part)
            for s in STYLES
            if getattr(s, part) is not None and getattr(s, part) + probe in file_keys
        }
        for part, probe in _PROBES.items()
    }
    for part, prefixes in present.items():
        if len(prefixes) > 1:
            names = ", ".join(repr(p + _PROBES[part]) for p in sorted(prefixes))
            raise ConfigError(f"{where}: more than one {part} model ({names})")
    found = {part: next(iter(p)) if p else None for part, p in present.items()}
    for style in STYLES:
        if all(getattr(style, part) == found[part] for part in _PROBES):
            return style
    parts = ", ".join(f"{part} {p!r}" for part, p in found.items() if p is not None)
    seen = f"found {parts}" if parts else "no embeddings.patch_embedding, linear_1 or embed_tokens"
    raise ConfigError(
        f"{where}: no known tensor-name style ({seen}; known: {', '.join(s.name for s in STYLES)})"
    )


def _vision_names(args: VLMArgs, p: str) -> dict[str, str]:
    v = args.vision
    names = {"vision.patch_embed.weight": f"{p}embeddings.patch_embedding.weight"}
    if v.patch_bias:
        names["vision.patch_embed.bias"] = f"{p}embeddings.patch_embedding.bias"
    if v.class_token:
        names["vision.class_embedding"] = f"{p}embeddings.class_embedding"
    names["vision.pos_embed"] = f"{p}embeddings.position_embedding.weight"
    kinds = ("weight", "bias")
    if v.pre_norm:
        names.update({f"vision.pre_norm.{k}": f"{p}pre_layrnorm.{k}" for k in kinds})
    per_layer = {
        "norm1": "layer_norm1",
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.proj": "self_attn.out_proj",
        "norm2": "layer_norm2",
        "fc1": "mlp.fc1",
        "fc2": "mlp.fc2",
    }
    for i in range(v.n_layers):
        for ours, hf in per_layer.items():
            for k in kinds:
                names[f"vision.layers.{i}.{ours}.{k}"] = f"{p}encoder.layers.{i}.{hf}.{k}"
    if v.post_norm:
        names.update({f"vision.norm.{k}": f"{p}post_layernorm.{k}" for k in kinds})
    return names


def _projector_names(args: VLMArgs, p: str) -> dict[str, str]:
    kinds = ("weight", "bias") if args.projector_bias else ("weight",)
    return {f"projector.fc{n}.{k}": f"{p}linear_{n}.{k}" for n in (1, 2) for k in kinds}


def _names(args: VLMArgs, style: KeyStyle) -> dict[str, str]:
    names: dict[str, str] = {}
    if style.vision is not None:
        names.update(_vision_names(args, style.vision))
    if style.projector is not None:
        names.update(_projector_names(args, style.projector))
    if style.text is not None:
        assert style.head is not None
        names.update(decoder_hf_names(args.decoder, style.text, style.head))
    return names


def unused_hf_tensors(args: VLMArgs, file_keys: set[str]) -> dict[str, str]:
    """The tensors in `file_keys` that the model knowingly does not use, each with the reason (the
    loader reports them in one line)."""
    style = key_style(file_keys)
    unused: dict[str, str] = {}
    v, d = args.vision, args.decoder
    for key in sorted(file_keys):
        reason = None
        if style.vision is not None and key.startswith(style.vision):
            rest = key[len(style.vision) :]
            if rest.startswith("encoder.layers."):
                layer = int(rest.split(".")[2])
                if layer >= v.n_layers:
                    reason = f"vision layer {layer}: past the features' layer ({v.n_layers} run)"
            elif rest.startswith("post_layernorm.") and not v.post_norm:
                reason = "post_layernorm: not applied to the features"
            elif rest.startswith("head."):
                reason = "SigLIP's pooling head"
            elif rest == "embeddings.position_ids":
                reason = "position_ids buffer"
        if style.text is None and style.projector is None and key.startswith(_CONTRASTIVE_REST):
            reason = "the contrastive model's text tower and projections"
        if style.text is not None and key.startswith(style.text):
            if key.endswith("rotary_emb.inv_freq"):
                reason = "rotary inv_freq buffer"
        if key == style.head and d.tie_embeddings:
            reason = "lm_head: the embeddings are tied (the head is embed_tokens)"
        if reason is not None:
            unused[key] = reason
    return unused


def hf_names(
    args: VLMArgs, file_keys: set[str], where: str = "the safetensors files"
) -> dict[str, str]:
    """{our parameter name: Hugging Face tensor name} for every parameter of the parts present in
    `file_keys` (a LLaVA file: all of them; a vision-tower or causal-LM folder: its part). Every
    name returned is in `file_keys`; a tensor the parts need and the files lack is an error, and so
    is a tensor in the files that is neither mapped nor in `unused_hf_tensors`."""
    style = key_style(file_keys, where)
    names = _names(args, style)
    unused = set(unused_hf_tensors(args, file_keys))
    check_file_coverage(names, unused, file_keys, where, style.name)
    return names


def export_names(args: VLMArgs, style: KeyStyle = LLAVA_HF5) -> dict[str, str]:
    """{our parameter name: Hugging Face tensor name} to write a folder of `style` (by default what
    transformers 5 writes for LLaVA). Every parameter is named; tied embeddings write
    embed_tokens only. The source's unused tensors (unused_hf_tensors) are not ours to write: an
    export that must load without missing tensors copies them from the source files."""
    for part in ("vision", "projector", "text"):
        if getattr(style, part) is None:
            raise ConfigError(f"key style {style.name!r} has no names for the {part} model")
    return _names(args, style)
