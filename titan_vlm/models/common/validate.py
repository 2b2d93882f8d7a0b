"""Checks of a job's shapes that several families' ModelSpec.validate share (each finding a
one-line ConfigError naming the key)."""

from __future__ import annotations

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.text_args import DecoderArgs


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
