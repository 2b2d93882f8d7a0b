"""What the "qwen3_vl" family needs of the job (its ModelSpec.validate): Qwen2.5-VL's checks
(common/qwen_vl/validate.py: causal image slots, its own image sizing, heads, the all-to-all's
heads, the tokenizer's vocabulary), and no tensor parallelism yet (parallelize.py). One line
each."""

from __future__ import annotations

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl.validate import validate as qwen2_5_vl_validate
from titan_vlm.models.qwen3_vl.args import Qwen3VLArgs
from titan_vlm.parallel_dims import ParallelDims


def validate(args: Qwen3VLArgs, dims: ParallelDims, cfg: JobConfig) -> None:
    """ModelSpec.validate (module docstring); the first finding is raised."""
    if dims.tp > 1:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={dims.tp}: the qwen3_vl family has no tensor "
            "parallel plan yet (use FSDP and context parallelism)"
        )
    qwen2_5_vl_validate(args, dims, cfg)
