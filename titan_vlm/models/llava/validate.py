"""What the "llava" family needs of the job's shapes and mesh (its ModelSpec.validate, called by
validate.py validate_job after the generic checks): room for text after the images, the RoPE
table, the heads, the vocabulary, native-resolution images, tensor / sequence parallelism and the
all-to-all's heads. Each finding is a one-line ConfigError naming the key."""

from __future__ import annotations

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.validate import check_experts, check_tp_divides, decoder_tp_sizes
from titan_vlm.models.llava.args import VLMArgs
from titan_vlm.parallel_dims import ParallelDims


def validate(vlm: VLMArgs, dims: ParallelDims, cfg: JobConfig) -> None:
    from titan_vlm.data import model_inputs

    t, k = cfg.training, cfg.data.images_per_sample
    if t.seq_len <= k * vlm.tokens_per_image + 2:
        raise ConfigError(
            f"training.seq_len={t.seq_len} leaves no room for text after {k} images of "
            f"{vlm.tokens_per_image} tokens (flavor '{cfg.model.flavor}', "
            f"data.images_per_sample={k})"
        )
    if t.seq_len > vlm.decoder.max_seq_len:  # RoPE positions restart at every sample
        raise ConfigError(
            f"training.seq_len={t.seq_len} exceeds the RoPE table of flavor "
            f"'{cfg.model.flavor}' (max_seq_len {vlm.decoder.max_seq_len})"
        )
    dec = vlm.decoder
    if dec.n_heads % dec.n_kv_heads:
        raise ConfigError(
            f"model.flavor={cfg.model.flavor}: n_heads {dec.n_heads} not divisible by "
            f"n_kv_heads {dec.n_kv_heads}"
        )
    vocab = model_inputs(cfg)[0].vocab_size
    if vocab > vlm.decoder.vocab_size:
        raise ConfigError(
            f"model.tokenizer_path: the tokenizer has {vocab} ids, flavor '{cfg.model.flavor}' "
            f"embeds {vlm.decoder.vocab_size}"
        )
    _validate_native(vlm, cfg)
    check_experts(dec, dims, cfg)  # before the TP sizes: experts have no TP plan
    _validate_tp(vlm, dims, cfg)
    local_heads = dec.n_heads // dims.tp  # after TP: the heads the a2a splits over cp
    if cfg.parallelism.cp_comm_type == "a2a" and local_heads % dims.cp:
        per_rank = (
            f" per tp rank ({dec.n_heads} / tensor_parallel_degree={dims.tp})"
            if dims.tp > 1
            else ""
        )
        raise ConfigError(
            f"parallelism.cp_comm_type='a2a' needs the {local_heads} attention "
            f"heads{per_rank} of "
            f"flavor '{cfg.model.flavor}' to divide by context_parallel_degree={dims.cp}"
        )


def _validate_native(vlm: VLMArgs, cfg: JobConfig) -> None:
    """data.native_resolution_pixels: images of their own sizes, whole patches of the ViT. It
    composes with compile and sequence parallelism (the ViT's packed sequence is one varlen plan,
    padded to whole tp slices: vit.py ViT.sequence_multiple); not with a LLaVA folder, whose
    image processor fixes every image's size (Qwen2.5-VL folders are the native-resolution
    folders)."""
    native = cfg.data.native_resolution_pixels
    if native:
        patch = vlm.vision.patch_size
        if cfg.model.hf_path:
            # a LLaVA folder's image processor fixes every image's size (and so its <image>
            # expansion): the folder's preprocessing would no longer be transformers'
            raise ConfigError(
                "data.native_resolution_pixels > 0 does not combine with model.hf_path: the "
                "folder's image processor fixes every image's size (set it to 0)"
            )
        if native < patch * patch:
            raise ConfigError(
                f"data.native_resolution_pixels={native} is less than one {patch}x{patch} "
                "patch of the ViT"
            )


def _validate_tp(vlm: VLMArgs, dims: ParallelDims, cfg: JobConfig) -> None:
    """What tensor / sequence parallelism needs of the shapes: whole heads, K/V heads and MLP
    columns per tp rank, and (SP) ViT sequences that split evenly over tp."""
    p, tp = cfg.parallelism, dims.tp
    if tp == 1:
        return
    dec, vit = vlm.decoder, vlm.vision
    vit_sizes = [("ViT n_heads", vit.n_heads), ("ViT mlp_dim", vit.mlp_dim)]
    check_tp_divides(tp, cfg.model.flavor, decoder_tp_sizes(dec) + vit_sizes)
    if (
        p.enable_sequence_parallel
    ):  # the decoder's local slots are padded to a multiple of tp (layout/)
        if vit.num_positions % tp:
            raise ConfigError(
                f"parallelism.enable_sequence_parallel: the ViT's {vit.num_positions} "
                "positions per image "
                f"must divide by tensor_parallel_degree={tp}"
            )
