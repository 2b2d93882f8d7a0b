"""What the "qwen2_5_vl" family needs of the job's shapes and mesh (its ModelSpec.validate, called
by validate.py validate_job after the generic checks): a vision tower, patch merger and decoder
that tensor parallelism splits into whole pieces (parallelize.py), causal image slots, the
family's own image sizing, the decoder's heads, the all-to-all's heads and the tokenizer's
vocabulary. Each finding is a one-line ConfigError naming the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.processor import model_inputs
from titan_vlm.models.common.validate import check_experts, check_tp_divides, decoder_tp_sizes
from titan_vlm.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from titan_vlm.data.hf_processor import HFProcessor
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer


def validate(
    args: Qwen25VLArgs,
    dims: ParallelDims,
    cfg: JobConfig,
    inputs: Callable[[JobConfig], tuple[ByteTokenizer | HFTokenizer, HFProcessor | None]] = (
        model_inputs
    ),
) -> None:
    """ModelSpec.validate: every check of the module docstring, in order; the first finding is
    raised. `inputs`: the family's ModelSpec.inputs (its tokenizer's vocabulary is checked)."""
    flavor = cfg.model.flavor
    p = cfg.parallelism
    check_experts(args.decoder, dims, cfg)
    if dims.tp > 1:
        check_tp_divides(dims.tp, flavor, vision_tp_sizes(args) + decoder_tp_sizes(args.decoder))
    if cfg.model.image_attention != "causal":
        raise ConfigError(
            f"model.image_attention={cfg.model.image_attention!r}: Qwen2.5-VL's image slots are "
            "causal in the decoder (set it to 'causal')"
        )
    if cfg.data.native_resolution_pixels:
        raise ConfigError(
            f"data.native_resolution_pixels={cfg.data.native_resolution_pixels}: qwen2_5_vl "
            "sizes its images itself (its processor's smart_resize); set it to 0"
        )
    d = args.decoder
    if d.n_heads % d.n_kv_heads:
        raise ConfigError(
            f"model.flavor={flavor}: the decoder's n_heads {d.n_heads} is not divisible by "
            f"n_kv_heads {d.n_kv_heads}"
        )
    local_heads = d.n_heads // dims.tp  # after TP: the heads the a2a splits over cp
    if p.cp_comm_type == "a2a" and local_heads % dims.cp:
        raise ConfigError(
            f"parallelism.cp_comm_type='a2a' needs the {local_heads} attention heads (per tp "
            f"rank) of flavor '{flavor}' to divide by context_parallel_degree={dims.cp}"
        )
    vocab = inputs(cfg)[0].vocab_size
    if vocab > d.vocab_size:
        key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.hf_path"
        raise ConfigError(
            f"{key}: the tokenizer has {vocab} ids, flavor '{flavor}' embeds {d.vocab_size}"
        )


def vision_tp_sizes(args: Qwen25VLArgs) -> list[tuple[str, int]]:
    """What tensor parallelism splits of the vision tower (parallelize.py apply_tp), for
    `check_tp_divides`: the heads of q, k, v and the gated MLP's columns. The merger's hidden
    columns (hidden_size * spatial_merge_size^2) then divide too, its output is the decoder's
    dim (checked with the decoder's sizes), and the packed patch sequence needs nothing:
    sequence parallelism pads it (vision.py)."""
    v = args.vision
    return [("vision num_heads", v.num_heads), ("vision intermediate_size", v.intermediate_size)]
