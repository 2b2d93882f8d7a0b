"""The "qwen2_5_vl" family's ModelSpec (models/spec.py), the registry's entry `QWEN2_5_VL`.

Where the architecture comes from (`qwen_args`):
  model.hf_path = <folder>   a Qwen2.5-VL folder's config.json; with model.flavor = "hf" it IS
                             the architecture, with a built-in flavor it must agree with it
  neither                    the built-in flavor ("debug": CPU-sized, trained from scratch)
"""

from __future__ import annotations

import dataclasses

from titan_vlm.config import JobConfig
from titan_vlm.data.batch import SlotData
from titan_vlm.data.image_batch import ImageRule
from titan_vlm.models.common.decoder import after_to_empty
from titan_vlm.models.common.hf_config import whole_model_args
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.flops import batch_train_flops, layout_cost
from titan_vlm.models.common.qwen_vl.images import folder_rule
from titan_vlm.models.common.qwen_vl.model import init_rule
from titan_vlm.models.common.qwen_vl.processor import model_inputs
from titan_vlm.models.common.qwen_vl.validate import validate
from titan_vlm.models.qwen2_5_vl.hf_adapter import (
    export_names,
    hf_names,
    hf_same,
    unused_hf_tensors,
)
from titan_vlm.models.qwen2_5_vl.hf_config import args_from_hf_config
from titan_vlm.models.qwen2_5_vl.model import Qwen25VL
from titan_vlm.models.qwen2_5_vl.parallelize import parallelize
from titan_vlm.models.qwen2_5_vl.shapes import plan_shapes
from titan_vlm.models.spec import ModelSpec

# The built-in shapes: "debug" trains in well under a second a step on a CPU (a 4-block tower
# with windows of 2x2 merge units and two full-attention blocks; a 2-layer Qwen2 decoder).
FLAVORS: dict[str, Qwen25VLArgs] = {"debug": Qwen25VLArgs()}


def qwen_args(cfg: JobConfig) -> Qwen25VLArgs:
    """The architecture the config asks for (module docstring), with model.attention_kernel."""
    args = whole_model_args(cfg, "qwen2_5_vl", FLAVORS, args_from_hf_config)
    return dataclasses.replace(args, attention_kernel=cfg.model.attention_kernel)


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
    plan_shapes=plan_shapes,
    # the patch merger maps the tower's features into the decoder: the family's projector
    param_groups=(("vision.", "vision"), ("vision.merger.", "projector"), ("decoder.", "decoder")),
)
