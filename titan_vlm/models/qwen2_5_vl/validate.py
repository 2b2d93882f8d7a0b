"""What the "qwen2_5_vl" family needs of the job's shapes and mesh (its ModelSpec.validate, called
by validate.py validate_job after the generic checks): no tensor or sequence parallelism yet,
causal image slots, the family's own image sizing, the decoder's heads, the all-to-all's heads
and the tokenizer's vocabulary. Each finding is a one-line ConfigError naming the key."""

from __future__ import annotations

from pathlib import Path

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.qwen2_5_vl.args import Qwen25VLArgs
from titan_vlm.parallel_dims import ParallelDims


def validate(args: Qwen25VLArgs, dims: ParallelDims, cfg: JobConfig) -> None:
    """ModelSpec.validate: every check of the module docstring, in order; the first finding is
    raised."""
    flavor = cfg.model.flavor
    p = cfg.parallelism
    # validate_job refuses these two with tp == 1; named here too, so that a job with tp > 1
    # (refused just below) hears of them, and a direct call sees them
    for key in ("enable_sequence_parallel", "image_embed_tp_shard"):
        if getattr(p, key):
            raise ConfigError(
                f"parallelism.{key} is not yet for qwen2_5_vl: it has no tensor parallelism"
            )
    if dims.tp > 1:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={dims.tp} is not yet for qwen2_5_vl: its vision "
            "attention's fused qkv needs its own plan (set it to 1)"
        )
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
    if p.cp_comm_type == "a2a" and d.n_heads % dims.cp:
        raise ConfigError(
            f"parallelism.cp_comm_type='a2a' needs the {d.n_heads} attention heads of flavor "
            f"'{flavor}' to divide by context_parallel_degree={dims.cp}"
        )
    vocab = tokenizer_vocab(cfg)
    if vocab is not None and vocab > d.vocab_size:
        key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.hf_path"
        raise ConfigError(
            f"{key}: the tokenizer has {vocab} ids, flavor '{flavor}' embeds {d.vocab_size}"
        )


def tokenizer_vocab(cfg: JobConfig) -> int | None:
    """The vocabulary size (highest id + 1) of the tokenizer the job's text would be encoded
    with, or None where that is not known here.

    Not data.model_inputs, as the llava family does: for a Qwen2.5-VL folder it builds a LLaVA
    HFProcessor, which fails (no vision_config.image_size in the config.json, no '<image>'
    token). Instead, in model_inputs' order: model.tokenizer_path's tokenizer.json; else
    model.hf_path's tokenizer as transformers loads it (HFTokenizer.from_folder), if the folder
    has a tokenizer.json (without one: None, unchecked; whatever tokenizer the data path then
    uses is its own check); else the built-in byte tokenizer."""
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

    m = cfg.model
    if m.tokenizer_path:
        return build_tokenizer(m.tokenizer_path).vocab_size
    if m.hf_path:
        folder = Path(m.hf_path)
        if folder.is_dir() and (folder / "tokenizer.json").is_file():
            return HFTokenizer.from_folder(folder).vocab_size
        return None
    return ByteTokenizer.vocab_size
