"""Checks of a job's shapes that several families' ModelSpec.validate share (each finding a
one-line ConfigError naming the key)."""

from __future__ import annotations

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.text_args import DecoderArgs
from titan_vlm.parallel_dims import ParallelDims


def check_tp_divides(tp: int, flavor: str, sizes: list[tuple[str, int]]) -> None:
    """Tensor parallelism splits each of `sizes` ((what, size): heads, K/V heads, MLP columns,
    vocabulary, ...) into tp whole pieces: the first that does not divide is one line."""
    for what, value in sizes:
        if value % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree={tp} does not divide the {what} ({value}) "
                f"of flavor '{flavor}'"
            )


def decoder_tp_sizes(d: DecoderArgs) -> list[tuple[str, int]]:
    """What tensor parallelism splits of the shared decoder (parallel/tensor_parallel.py
    apply_decoder_tp), for `check_tp_divides`."""
    return [
        ("decoder n_heads", d.n_heads),
        ("decoder n_kv_heads", d.n_kv_heads),
        ("decoder ffn_dim", d.ffn_dim),
        ("decoder dim", d.dim),
        ("decoder vocab_size", d.vocab_size),
    ]


def check_experts(d: DecoderArgs, dims: ParallelDims, cfg: JobConfig) -> None:
    """A mixture-of-experts decoder's TP plan has no sequence parallelism (its attention is
    split over tp, its experts whole on every tp rank); expert parallelism needs experts, and
    whole experts on every rank of its group."""
    if d.moe is not None and dims.tp > 1 and cfg.parallelism.enable_sequence_parallel:
        raise ConfigError(
            f"parallelism.enable_sequence_parallel with tensor_parallel_degree={dims.tp}: a "
            "mixture-of-experts decoder's TP plan splits its attention only, with the experts "
            "on the whole sequence; set it to false"
        )
    if dims.ep == 1:
        return
    if d.moe is None:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={dims.ep}: the decoder has no experts"
        )
    if d.moe.num_experts % dims.ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={dims.ep} does not divide the decoder's "
            f"{d.moe.num_experts} experts"
        )
