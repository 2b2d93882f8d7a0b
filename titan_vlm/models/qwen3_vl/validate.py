"""What the "qwen3_vl" family needs of the job (its ModelSpec.validate): Qwen2.5-VL's checks
(common/qwen_vl/validate.py: causal image slots, its own image sizing, heads, tensor-parallel
divisibility, the all-to-all's heads, the tokenizer's vocabulary, experts), and of tensor
parallelism no sequence parallelism and no image embeddings sharded over tp yet
(parallelize.py), and of pipeline parallelism a first stage holding the layers DeepStack adds
after (model.py). One line each."""

from __future__ import annotations

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl.validate import validate as qwen2_5_vl_validate
from titan_vlm.models.qwen3_vl.args import Qwen3VLArgs
from titan_vlm.models.qwen3_vl.video import qwen3_inputs
from titan_vlm.parallel.pipeline import balanced_split, parse_stage_layers
from titan_vlm.parallel_dims import ParallelDims


def validate(args: Qwen3VLArgs, dims: ParallelDims, cfg: JobConfig) -> None:
    """ModelSpec.validate (module docstring); the first finding is raised."""
    p = cfg.parallelism
    if dims.tp > 1 and p.enable_sequence_parallel:
        raise ConfigError(
            f"parallelism.enable_sequence_parallel with tensor_parallel_degree={dims.tp}: the "
            "qwen3_vl family's TP plan has no sequence parallelism yet (DeepStack adds features "
            "to the residual stream SP would cut); set it to false"
        )
    if dims.tp > 1 and p.image_embed_tp_shard:
        raise ConfigError(
            "parallelism.image_embed_tp_shard: a Qwen3-VL image slot's row holds its embedding "
            "and its DeepStack features, kept whole over tp; set it to false"
        )
    if dims.pp > 1:  # DeepStack's layers on the first stage (model.py Qwen3VL.decode_stage)
        stages = dims.pp * p.pipeline_parallel_stages_per_rank
        k, n = args.deepstack, args.decoder.n_layers
        try:  # the split's own checks (parallel/pipeline.py), the first stage holding k
            balanced_split(n, stages, 0.0, 0.0, k)
            parse_stage_layers(p.pipeline_parallel_stage_layers, stages, n, k)
        except ValueError as e:
            raise ConfigError(f"parallelism.pipeline_parallel_degree={dims.pp}: {e}") from None
    qwen2_5_vl_validate(args, dims, cfg, qwen3_inputs)
