"""Hugging Face tensor names <-> titan_vlm parameter names of the "qwen2_5_vl" family, both
directions. Pure functions of the args and the names in the files: no tensors, no IO.

Every parameter has the shape of its Hugging Face tensor (the patch embedding the Conv3d weight
[dim, C, T, P, P]), so loading is a rename, except the vision attention's fused qkv [3 * dim,
dim]: our q, k and v (vision.py) all name it, in that order, and so are its dim-0 thirds (the
fused-tensor rule of ModelSpec.hf_names, common/hf_adapter.py `hf_tensor_parts`: loading reads
each third, export concatenates them).

Key styles, resolved from the names present (`key_style`):

    save_pretrained, transformers 4.x and 5.x,   visual.*          model.*   lm_head.weight
    and the hub's Qwen/Qwen2.5-VL-* folders
    in-memory names of transformers 5            model.visual.*    model.language_model.*
                                                                   lm_head.weight

Tensors the model knowingly does not use (`unused_hf_tensors`): rotary inv_freq buffers of old
files, and lm_head when the embeddings are tied (the head IS embed_tokens: our one parameter maps
to embed_tokens, and an export writes no lm_head; `hf_same` asks the loader to check that a head
the files still hold equals it). Any other tensor in the files that no parameter takes is an
error (`hf_names`).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.hf_adapter import check_file_coverage, decoder_hf_names
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs


@dataclass(frozen=True)
class KeyStyle:
    """Where each part's tensors live in a file: the vision tower's and the text model's name
    prefixes and the output head's full name."""

    name: str
    vision: str
    text: str
    head: str


SAVED = KeyStyle("qwen2_5_vl (save_pretrained, the hub)", "visual.", "model.", "lm_head.weight")
IN_MEMORY = KeyStyle(
    "qwen2_5_vl (transformers 5 in-memory names)",
    "model.visual.",
    "model.language_model.",
    "lm_head.weight",
)
STYLES = (SAVED, IN_MEMORY)
_VISION_PROBE = "patch_embed.proj.weight"
_TEXT_PROBE = "embed_tokens.weight"


def key_style(file_keys: set[str], where: str = "the safetensors files") -> KeyStyle:
    """The one style whose vision and text probes are both in `file_keys`."""
    found = [
        s
        for s in STYLES
        if s.vision + _VISION_PROBE in file_keys and s.text + _TEXT_PROBE in file_keys
    ]
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(repr(s.vision + _VISION_PROBE) for s in found)
        raise ConfigError(f"{where}: more than one Qwen2.5-VL model ({names})")
    probes = ", ".join(f"{s.vision}{_VISION_PROBE} + {s.text}{_TEXT_PROBE}" for s in STYLES)
    raise ConfigError(f"{where}: not a Qwen2.5-VL folder (none of {probes})")


def _vision_names(args: Qwen25VLArgs, p: str) -> dict[str, str]:
    names = {
        "vision.patch_embed.weight": f"{p}patch_embed.proj.weight",
        "vision.merger.norm.weight": f"{p}merger.ln_q.weight",
    }
    per_layer = {
        "norm1.weight": "norm1.weight",
        "norm2.weight": "norm2.weight",
        **{
            f"{ours}.{k}": f"{hf}.{k}"
            for ours, hf in (
                ("attn.q", "attn.qkv"),  # q, k, v: attn.qkv's dim-0 thirds, in order
                ("attn.k", "attn.qkv"),
                ("attn.v", "attn.qkv"),
                ("attn.proj", "attn.proj"),
                ("mlp.w1", "mlp.gate_proj"),
                ("mlp.w3", "mlp.up_proj"),
                ("mlp.w2", "mlp.down_proj"),
            )
            for k in ("weight", "bias")
        },
    }
    for i in range(args.vision.depth):
        for ours, hf in per_layer.items():
            names[f"vision.layers.{i}.{ours}"] = f"{p}blocks.{i}.{hf}"
    for n, index in ((1, 0), (2, 2)):  # merger.mlp is Sequential(Linear, GELU, Linear)
        for k in ("weight", "bias"):
            names[f"vision.merger.fc{n}.{k}"] = f"{p}merger.mlp.{index}.{k}"
    return names


def _names(args: Qwen25VLArgs, style: KeyStyle) -> dict[str, str]:
    return {
        **_vision_names(args, style.vision),
        **decoder_hf_names(args.decoder, style.text, style.head),
    }


def unused_hf_tensors(args: Qwen25VLArgs, file_keys: set[str]) -> dict[str, str]:
    """The tensors in `file_keys` that the model knowingly does not use, each with the reason (the
    loader reports them in one line)."""
    style = key_style(file_keys)
    unused: dict[str, str] = {}
    for key in sorted(file_keys):
        if key.endswith("inv_freq") and key.startswith((style.vision, style.text)):
            unused[key] = "rotary inv_freq buffer"
        elif key == style.head and args.decoder.tie_embeddings:
            unused[key] = "lm_head: the embeddings are tied (the head is embed_tokens)"
    return unused


def hf_names(
    args: Qwen25VLArgs, file_keys: set[str], where: str = "the safetensors files"
) -> dict[str, str]:
    """{our parameter name: Hugging Face tensor name} for every parameter. Every name returned is
    in `file_keys`; a tensor the model needs and the files lack is an error, and so is a tensor in
    the files that is neither mapped nor in `unused_hf_tensors`."""
    style = key_style(file_keys, where)
    names = _names(args, style)
    unused = set(unused_hf_tensors(args, file_keys))
    check_file_coverage(names, unused, file_keys, where, style.name)
    return names


def hf_same(args: Qwen25VLArgs, file_keys: set[str]) -> list[tuple[str, str]]:
    """(file tensor, the file tensor it must equal): with tied embeddings, a head the files still
    hold must be the embedding, else the config and the weights disagree."""
    if not args.decoder.tie_embeddings:
        return []
    style = key_style(file_keys)
    if style.head not in file_keys:
        return []
    return [(style.head, f"{style.text}embed_tokens.weight")]


def export_names(args: Qwen25VLArgs, style: KeyStyle = SAVED) -> dict[str, str]:
    """{our parameter name: Hugging Face tensor name} to write a folder of `style` (by default what
    save_pretrained writes). Every parameter is named; tied embeddings write embed_tokens only."""
    return _names(args, style)
