"""Hugging Face tensor names <-> titan_vlm parameter names of the "qwen3_vl" family, both
directions. Pure functions of the args and the names in the files: no tensors, no IO.

One key style: what save_pretrained writes and the hub's Qwen/Qwen3-VL-* folders hold,
`model.visual.*`, `model.language_model.*`, `lm_head.weight`. Every parameter has the shape of
its Hugging Face tensor except the vision attention's fused qkv [3 * dim, dim], whose dim-0
thirds are our q, k and v (common/hf_adapter.py hf_tensor_parts: loading reads each third,
export concatenates them). The DeepStack mergers are `deepstack_merger_list.<j>`.

Tensors the model knowingly does not use (`unused_hf_tensors`): rotary inv_freq buffers, and
lm_head when the embeddings are tied (`hf_same` asks the loader to check that a head the files
still hold equals the embedding). Any other tensor no parameter takes is an error.
"""

from __future__ import annotations

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.hf_adapter import check_file_coverage, decoder_hf_names
from titan_vlm.models.qwen3_vl.args import Qwen3VLArgs

VISION, TEXT, HEAD = "model.visual.", "model.language_model.", "lm_head.weight"
STYLE = "qwen3_vl (save_pretrained, the hub)"
_PROBES = (f"{VISION}patch_embed.proj.weight", f"{TEXT}embed_tokens.weight")


def _merger(ours: str, theirs: str) -> dict[str, str]:
    return {
        f"{ours}.{part}.{k}": f"{theirs}.{hf}.{k}"
        for part, hf in (("norm", "norm"), ("fc1", "linear_fc1"), ("fc2", "linear_fc2"))
        for k in ("weight", "bias")
    }


def _vision_names(args: Qwen3VLArgs) -> dict[str, str]:
    p = VISION
    names = {
        "vision.patch_embed.weight": f"{p}patch_embed.proj.weight",
        "vision.patch_embed.bias": f"{p}patch_embed.proj.bias",
        "vision.pos_embed.weight": f"{p}pos_embed.weight",
    }
    per_layer = {
        f"{ours}.{k}": f"{hf}.{k}"
        for ours, hf in (
            ("norm1", "norm1"),
            ("norm2", "norm2"),
            ("attn.q", "attn.qkv"),  # q, k, v: attn.qkv's dim-0 thirds, in order
            ("attn.k", "attn.qkv"),
            ("attn.v", "attn.qkv"),
            ("attn.proj", "attn.proj"),
            ("mlp.fc1", "mlp.linear_fc1"),
            ("mlp.fc2", "mlp.linear_fc2"),
        )
        for k in ("weight", "bias")
    }
    for i in range(args.vision.depth):
        for ours, hf in per_layer.items():
            names[f"vision.layers.{i}.{ours}"] = f"{p}blocks.{i}.{hf}"
    names.update(_merger("vision.merger", f"{p}merger"))
    for j in range(args.deepstack):
        names.update(_merger(f"vision.deepstack_mergers.{j}", f"{p}deepstack_merger_list.{j}"))
    return names


def _names(args: Qwen3VLArgs) -> dict[str, str]:
    return {**_vision_names(args), **decoder_hf_names(args.decoder, TEXT, HEAD)}


def _check_style(file_keys: set[str], where: str) -> None:
    if not all(probe in file_keys for probe in _PROBES):
        raise ConfigError(f"{where}: not a Qwen3-VL folder (no {' + '.join(_PROBES)})")


def unused_hf_tensors(args: Qwen3VLArgs, file_keys: set[str]) -> dict[str, str]:
    """The tensors in `file_keys` that the model knowingly does not use, each with the reason."""
    unused: dict[str, str] = {}
    for key in sorted(file_keys):
        if key.endswith("inv_freq") and key.startswith((VISION, TEXT)):
            unused[key] = "rotary inv_freq buffer"
        elif key == HEAD and args.decoder.tie_embeddings:
            unused[key] = "lm_head: the embeddings are tied (the head is embed_tokens)"
    return unused


def hf_names(
    args: Qwen3VLArgs, file_keys: set[str], where: str = "the safetensors files"
) -> dict[str, str]:
    """{our parameter name: Hugging Face tensor name} for every parameter; a tensor the model
    needs and the files lack, or one in the files neither mapped nor unused, is an error."""
    _check_style(file_keys, where)
    names = _names(args)
    check_file_coverage(names, set(unused_hf_tensors(args, file_keys)), file_keys, where, STYLE)
    return names


def hf_same(args: Qwen3VLArgs, file_keys: set[str]) -> list[tuple[str, str]]:
    """With tied embeddings, a head the files still hold must equal the embedding."""
    if not args.decoder.tie_embeddings or HEAD not in file_keys:
        return []
    return [(HEAD, f"{TEXT}embed_tokens.weight")]


def export_names(args: Qwen3VLArgs) -> dict[str, str]:
    """{our parameter name: Hugging Face tensor name} as save_pretrained writes them (a sparse
    layer's experts under common/hf_experts.py's stacked names, which an export writes in its
    source's layout)."""
    return _names(args)
