"""The "qwen3_vl" family's ModelSpec (models/spec.py), the registry's entry `QWEN3_VL`:
Qwen3-VL dense and mixture-of-experts (Qwen3VLForConditionalGeneration,
Qwen3VLMoeForConditionalGeneration). Where the architecture comes from:
  model.hf_path = <folder>   a Qwen3-VL or Qwen3-VL-MoE folder's config.json; with
                             model.flavor = "hf" it IS the architecture, with a built-in flavor
                             it must agree with it
  neither                    a built-in flavor ("debug", "debug_moe": CPU-sized, from scratch)

What it shares with qwen2_5_vl (the data path for images, M-RoPE positions, the processor and
tokenizer of a folder, the FLOPs and CP cost model, init rule) comes from models/common/qwen_vl;
the experts from models/common (moe.py, hf_experts.py); what differs is here (vision.py,
model.py, mrope.py, hf_adapter.py, hf_config.py, parallelize.py, and videos: video.py, their
frame timestamps, and images.py; what the planner prices: shapes.py). Not yet: sequence
parallelism (validate.py).
"""

from __future__ import annotations

import dataclasses

from titan_vlm.config import JobConfig
from titan_vlm.data.batch import SlotData
from titan_vlm.data.image_batch import ImageRule
from titan_vlm.models.common.decoder import after_to_empty
from titan_vlm.models.common.hf_config import whole_model_args, with_moe_config
from titan_vlm.models.common.qwen_vl.flops import batch_train_flops, layout_cost
from titan_vlm.models.common.qwen_vl.images import folder_rule
from titan_vlm.models.common.qwen_vl.model import init_rule
from titan_vlm.models.common.text_args import MoEArgs
from titan_vlm.models.qwen3_vl.args import Qwen3VLArgs
from titan_vlm.models.qwen3_vl.hf_adapter import (
    export_names,
    hf_names,
    hf_same,
    unused_hf_tensors,
)
from titan_vlm.models.qwen3_vl.hf_config import args_from_hf_config
from titan_vlm.models.qwen3_vl.images import Qwen3Rule
from titan_vlm.models.qwen3_vl.model import Qwen3VL
from titan_vlm.models.qwen3_vl.parallelize import parallelize
from titan_vlm.models.qwen3_vl.shapes import plan_shapes
from titan_vlm.models.qwen3_vl.validate import validate
from titan_vlm.models.qwen3_vl.video import QWEN3_VIDEO, qwen3_inputs
from titan_vlm.models.spec import ModelSpec

# "debug": a 3-block tower (16-pixel patches, a 4x4 learned position grid, DeepStack from blocks
# 0 and 1) and a 3-layer Qwen3 decoder; well under a second a step on a CPU.
# "debug_moe": the same with a mixture-of-experts decoder (4 experts, top 2, every layer sparse).
FLAVORS: dict[str, Qwen3VLArgs] = {
    "debug": Qwen3VLArgs(),
    "debug_moe": Qwen3VLArgs(
        decoder=dataclasses.replace(Qwen3VLArgs().decoder, moe=MoEArgs(ffn_dim=48))
    ),
}


def qwen3_args(cfg: JobConfig) -> Qwen3VLArgs:
    """The architecture the config asks for (module docstring), with model.attention_kernel."""
    args = whole_model_args(cfg, "qwen3_vl", FLAVORS, args_from_hf_config)
    return dataclasses.replace(
        args,
        decoder=with_moe_config(args.decoder, cfg),
        attention_kernel=cfg.model.attention_kernel,
    )


def data_rule(args: Qwen3VLArgs, cfg: JobConfig) -> tuple[ImageRule | None, SlotData | None]:
    """Images and videos at their own sizes (images.py Qwen3Rule, with model.hf_path's
    processor settings), and each sample's M-RoPE positions."""
    rule = folder_rule(args, cfg.model.hf_path, Qwen3Rule, QWEN3_VIDEO)
    return rule, rule.positions


QWEN3_VL = ModelSpec(
    name="qwen3_vl",
    hf_model_types=("qwen3_vl", "qwen3_vl_moe"),
    args=qwen3_args,
    build=Qwen3VL,
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
    inputs=qwen3_inputs,
    plan_shapes=plan_shapes,
    # the mergers (main and DeepStack) map the tower's features into the decoder: the projector
    param_groups=(
        ("vision.", "vision"),
        ("vision.merger.", "projector"),
        ("vision.deepstack_mergers.", "projector"),
        ("decoder.", "decoder"),
    ),
)
