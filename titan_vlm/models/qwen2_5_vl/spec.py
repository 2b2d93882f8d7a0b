"""The "qwen2_5_vl" family's ModelSpec (models/spec.py), the registry's entry `QWEN2_5_VL`.

Where the architecture comes from (`qwen_args`):
  model.hf_path = <folder>   a Qwen2.5-VL folder's config.json; with model.flavor = "hf" it IS
                             the architecture, with a built-in flavor it must agree with it
  neither                    the built-in flavor ("debug": CPU-sized, trained from scratch)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from titan_vlm.config import JobConfig
from titan_vlm.data.batch import SlotData
from titan_vlm.data.image_batch import ImageRule
from titan_vlm.errors import ConfigError
from titan_vlm.files import read_json
from titan_vlm.models.common.decoder import after_to_empty, decoder_weight_init
from titan_vlm.models.common.hf_config import first_difference
from titan_vlm.models.common.hf_folder import config_path
from titan_vlm.models.loading import Init
from titan_vlm.models.qwen2_5_vl.args import Qwen25VLArgs
from titan_vlm.models.qwen2_5_vl.flops import batch_train_flops, layout_cost
from titan_vlm.models.qwen2_5_vl.hf_adapter import (
    export_names,
    hf_names,
    hf_same,
    unused_hf_tensors,
)
from titan_vlm.models.qwen2_5_vl.hf_config import args_from_hf_config
from titan_vlm.models.qwen2_5_vl.images import folder_rule
from titan_vlm.models.qwen2_5_vl.model import Qwen25VL
from titan_vlm.models.qwen2_5_vl.parallelize import parallelize
from titan_vlm.models.qwen2_5_vl.processor import model_inputs
from titan_vlm.models.qwen2_5_vl.validate import validate
from titan_vlm.models.spec import ModelSpec

# The built-in shapes: "debug" trains in well under a second a step on a CPU (a 4-block tower
# with windows of 2x2 merge units and two full-attention blocks; a 2-layer Qwen2 decoder).
FLAVORS: dict[str, Qwen25VLArgs] = {"debug": Qwen25VLArgs()}


def qwen_args(cfg: JobConfig) -> Qwen25VLArgs:
    """The architecture the config asks for (module docstring), with model.attention_kernel."""
    m = cfg.model
    if m.hf_vision_path or m.hf_text_path:
        raise ConfigError(
            "model.hf_vision_path / hf_text_path: separate towers are the llava family's; a "
            "qwen2_5_vl model comes whole from model.hf_path (or a built-in flavor)"
        )
    if m.flavor != "hf" and m.flavor not in FLAVORS:
        raise ConfigError(
            f"model.flavor={m.flavor!r} is not a qwen2_5_vl flavor (known: "
            f"{', '.join(FLAVORS)}, hf)"
        )
    if m.hf_path:
        path = config_path(Path(m.hf_path))
        args = args_from_hf_config(read_json(path, "model.hf_path"), str(path))
        if m.flavor != "hf":
            diff = first_difference(FLAVORS[m.flavor], args)
            if diff:
                raise ConfigError(
                    f"model.flavor={m.flavor!r} does not match the config.json of {m.hf_path} "
                    f"({diff}); set model.flavor = 'hf' to take the architecture from the folder"
                )
    elif m.flavor == "hf":
        raise ConfigError("model.flavor='hf' reads the architecture from model.hf_path: set it")
    else:
        args = FLAVORS[m.flavor]
    return dataclasses.replace(args, attention_kernel=m.attention_kernel)


def init_rule(args: Qwen25VLArgs, name: str, param: torch.Tensor) -> Init:
    """How each parameter starts from scratch: norm weights ones, biases zeros; the decoder as
    the llava family's (normal 0.02, its residual outputs wo and w2 at 0.02/sqrt(2 * layers),
    an untied head at dim^-0.5); the tower's weights (linear layers, the patch embedding)
    uniform in +-1/sqrt(fan_in), PyTorch's default bound."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return Init("zeros")
    if "norm" in name:
        return Init("ones")
    if name.startswith("decoder."):
        return decoder_weight_init(args.decoder, name)
    return Init("uniform", 1 / math.sqrt(math.prod(param.shape[1:])))


def data_rule(args: Qwen25VLArgs, cfg: JobConfig) -> tuple[ImageRule | None, SlotData | None]:
    """Images and videos at their own sizes (QwenRule, with model.hf_path's processor bounds where
    the folder has processor files), and each sample's M-RoPE positions."""
    rule = folder_rule(args, cfg.model.hf_path)
    return rule, rule.positions


QWEN2_5_VL = ModelSpec(
    name="qwen2_5_vl",
    hf_model_types=("qwen2_5_vl",),
    args=qwen_args,
    build=Qwen25VL,
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
    plan_shapes=None,  # the planner does not price this family yet (docs/limits.md)
    # the patch merger maps the tower's features into the decoder: the family's projector
    param_groups=(("vision.", "vision"), ("vision.merger.", "projector"), ("decoder.", "decoder")),
)
