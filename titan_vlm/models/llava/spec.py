"""The "llava" family: a ViT (SigLIP- or CLIP-shaped) and an MLP projector feeding a decoder
(Llama, Mistral, Qwen2 or Qwen3), as transformers' LlavaForConditionalGeneration, plus the
built-in flavors (models/llava/args.py). Its `ModelSpec` (models/spec.py) is `LLAVA`.

Where the architecture comes from (`llava_args`):
  model.hf_path = <folder>      a LLaVA folder's config.json; with model.flavor = "hf" it IS the
                                architecture, with a built-in flavor it must agree with it
  model.hf_vision_path / hf_text_path
                                separate towers (a folder, or a .safetensors file beside its
                                config.json): a CLIP/SigLIP vision model and a Llama/Mistral/
                                Qwen decoder; the projector starts from training.seed
  neither                       the built-in flavor, trained from scratch
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_vlm.config import JobConfig
from titan_vlm.data import model_inputs, native_resolution
from titan_vlm.data.batch import SlotData
from titan_vlm.data.image_batch import ImageRule
from titan_vlm.errors import ConfigError
from titan_vlm.files import read_json
from titan_vlm.models.common.decoder import after_to_empty, decoder_weight_init
from titan_vlm.models.common.hf_config import first_difference, text_args_from_hf, with_moe_config
from titan_vlm.models.common.hf_folder import config_path, hf_sources
from titan_vlm.models.llava.args import IMAGE_ATTENTION, VLMArgs, get_flavor
from titan_vlm.models.llava.flops import batch_train_flops, layout_cost
from titan_vlm.models.llava.hf_adapter import export_names, hf_names, key_style, unused_hf_tensors
from titan_vlm.models.llava.hf_config import args_from_hf_config, vision_args_from_hf
from titan_vlm.models.llava.model import VLM
from titan_vlm.models.llava.parallelize import parallelize
from titan_vlm.models.llava.shapes import plan_shapes
from titan_vlm.models.llava.validate import validate
from titan_vlm.models.loading import Init
from titan_vlm.models.spec import ModelSpec

if TYPE_CHECKING:
    pass


def llava_args(cfg: JobConfig) -> VLMArgs:
    """The architecture the config asks for (module docstring), with model.image_attention and
    model.attention_kernel."""
    m = cfg.model
    if m.image_attention not in IMAGE_ATTENTION:
        raise ConfigError(
            f"model.image_attention must be one of {', '.join(IMAGE_ATTENTION)}, "
            f"got {m.image_attention!r}"
        )
    if m.hf_path and (m.hf_vision_path or m.hf_text_path):
        raise ConfigError(
            "model.hf_path is a whole model folder: leave model.hf_vision_path / hf_text_path empty"
        )
    if m.hf_path:
        path = config_path(Path(m.hf_path))
        from_hf = args_from_hf_config(read_json(path, "model.hf_path"), str(path))
    elif m.hf_vision_path or m.hf_text_path:
        if not (m.hf_vision_path and m.hf_text_path):
            raise ConfigError(
                "separate towers need both model.hf_vision_path and model.hf_text_path (the "
                "projector between them starts from training.seed)"
            )
        vision = text = None
        if m.hf_vision_path:
            path = config_path(Path(m.hf_vision_path), "model.hf_vision_path")
            vision = vision_args_from_hf(read_json(path, "model.hf_vision_path"), str(path))
        if m.hf_text_path:
            path = config_path(Path(m.hf_text_path), "model.hf_text_path")
            text = text_args_from_hf(read_json(path, "model.hf_text_path"), str(path))
        base = get_flavor(m.flavor) if m.flavor != "hf" else VLMArgs()
        if text is not None:  # a LLaVA trains without a router term (hf_config.py)
            text = text.with_router_weight(0)
        from_hf = dataclasses.replace(
            base, vision=vision or base.vision, decoder=text or base.decoder
        )
    elif m.flavor == "hf":
        raise ConfigError("model.flavor='hf' reads the architecture from model.hf_path: set it")
    else:
        from_hf = get_flavor(m.flavor)
    if m.flavor != "hf" and (m.hf_path or m.hf_vision_path):
        diff = first_difference(get_flavor(m.flavor), from_hf)
        if diff:
            where = ", ".join(str(p) for _, p in hf_sources(cfg))
            raise ConfigError(
                f"model.flavor={m.flavor!r} does not match the config.json of {where} ({diff}); "
                "set model.flavor = 'hf' to take the architecture from the folder"
            )
    return dataclasses.replace(
        from_hf,
        decoder=with_moe_config(from_hf.decoder, cfg),
        image_attention=m.image_attention,
        attention_kernel=m.attention_kernel,
    )


def _bias_fan_in(args: VLMArgs, name: str) -> int:
    """The fan-in of the linear layer or convolution a vision / projector bias belongs to (0
    for a norm's bias or the decoder's)."""
    v, layer = args.vision, name.rsplit(".", 2)[-2]
    if "norm" in name or name.startswith("decoder."):
        return 0
    if name == "vision.patch_embed.bias":
        return v.channels * v.patch_size**2
    if name.startswith("projector."):
        return v.dim if layer == "fc1" else args.decoder.dim
    return v.mlp_dim if layer == "fc2" else v.dim  # attn.q/k/v/proj and fc1 take the width


def init_rule(args: VLMArgs, name: str, param: torch.Tensor) -> Init:
    """How each parameter starts from scratch: weights of linear layers and the patch
    convolution uniform in +-1/sqrt(fan_in) (PyTorch's default), the decoder's matrices
    normal(0.02) with its residual outputs (wo, w2) at 0.02/sqrt(2 * layers) and its head at
    dim^-0.5, position embeddings and the class token normal(0.02), norm weights ones; the
    biases of the vision tower's and the projector's linear layers and convolution uniform in
    +-1/sqrt(fan_in) (PyTorch's default, as construction draws them), every other bias zeros."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        fan_in = _bias_fan_in(args, name)
        return Init("uniform", 1 / math.sqrt(fan_in)) if fan_in else Init("zeros")
    if "norm" in name:
        return Init("ones")
    if name.startswith("decoder."):
        return decoder_weight_init(args.decoder, name)
    if param.ndim < 2:  # position embeddings, class token
        return Init("normal", 0.02)
    if name.endswith(("pos_embed", "position_embedding.weight")):
        return Init("normal", 0.02)
    return Init("uniform", 1 / math.sqrt(math.prod(param.shape[1:])))


def hf_same(args: VLMArgs, file_keys: set[str]) -> list[tuple[str, str]]:
    """(file tensor, the file tensor it must equal): with tied embeddings, a head the file still
    holds must be the embedding, else the config and the weights disagree."""
    if not args.decoder.tie_embeddings:
        return []
    style = key_style(file_keys)
    if style.head is None or style.head not in file_keys or style.text is None:
        return []
    return [(style.head, f"{style.text}embed_tokens.weight")]


def data_rule(args: VLMArgs, cfg: JobConfig) -> tuple[ImageRule | None, SlotData | None]:
    """Images at the model's size, or with data.native_resolution_pixels > 0 at their own
    (data/images.py NativeResolution); no per-slot data (1-D RoPE from the layout)."""
    return native_resolution(cfg, args), None


LLAVA = ModelSpec(
    name="llava",
    hf_model_types=("llava",),
    args=llava_args,
    build=VLM,
    init_rule=init_rule,
    after_to_empty=after_to_empty,
    hf_names=hf_names,
    hf_unused=unused_hf_tensors,
    hf_same=hf_same,
    hf_export_names=export_names,
    parallelize=parallelize,
    flops=batch_train_flops,
    layout_cost=layout_cost,
    validate=validate,
    data_rule=data_rule,
    inputs=model_inputs,
    plan_shapes=plan_shapes,
    param_groups=(("vision.", "vision"), ("projector.", "projector"), ("decoder.", "decoder")),
)
