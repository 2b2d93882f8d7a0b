"""Load Hugging Face safetensors into titan_vlm's modules.

    model.hf_vision_path = "siglip/model.safetensors"   # SigLIP-style vision tower
                                                        # (+ LLaVA projector)
    model.hf_text_path   = "llama/model.safetensors"    # Llama/Qwen-style decoder

Names follow the public checkpoints: `vision_model.*` (SigLIP: no class token, separate q/k/v,
`post_layernorm`), `multi_modal_projector.linear_{1,2}` (LLaVA), `model.*` + `lm_head` (Llama).
Both sides use the rotate-half RoPE layout, so decoder weights map one to one. Every tensor of
the titan_vlm module must be found with the right shape; a missing or mis-shaped tensor fails
with its Hugging Face name. The flavor must match the checkpoint's shapes: `model.flavor = "hf"`
reads them from the config.json next to each safetensors file (`hf_flavor`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from titan_vlm.config import ConfigError
from titan_vlm.models.flavors import DecoderArgs, ViTArgs, VLMArgs


def vision_names(n_layers: int) -> dict[str, str]:
    """titan_vlm name -> Hugging Face name (one to one: the ViT has separate q/k/v like SigLIP)."""
    names: dict[str, str] = {
        "vision.patch_embed.weight": "vision_model.embeddings.patch_embedding.weight",
        "vision.patch_embed.bias": "vision_model.embeddings.patch_embedding.bias",
        "vision.pos_embed": "vision_model.embeddings.position_embedding.weight",
        "vision.norm.weight": "vision_model.post_layernorm.weight",
        "vision.norm.bias": "vision_model.post_layernorm.bias",
        "projector.fc1.weight": "multi_modal_projector.linear_1.weight",
        "projector.fc1.bias": "multi_modal_projector.linear_1.bias",
        "projector.fc2.weight": "multi_modal_projector.linear_2.weight",
        "projector.fc2.bias": "multi_modal_projector.linear_2.bias",
    }
    for i in range(n_layers):
        ours, hf = f"vision.layers.{i}.", f"vision_model.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            for p in "qkv":
                names[f"{ours}attn.{p}.{kind}"] = f"{hf}self_attn.{p}_proj.{kind}"
            names[f"{ours}attn.proj.{kind}"] = f"{hf}self_attn.out_proj.{kind}"
            names[f"{ours}norm1.{kind}"] = f"{hf}layer_norm1.{kind}"
            names[f"{ours}norm2.{kind}"] = f"{hf}layer_norm2.{kind}"
            names[f"{ours}fc1.{kind}"] = f"{hf}mlp.fc1.{kind}"
            names[f"{ours}fc2.{kind}"] = f"{hf}mlp.fc2.{kind}"
    return names


def text_names(n_layers: int) -> dict[str, str]:
    names = {
        "decoder.tok_embeddings.weight": "model.embed_tokens.weight",
        "decoder.norm.weight": "model.norm.weight",
        "decoder.output.weight": "lm_head.weight",
    }
    ours_to_hf = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    for i in range(n_layers):
        for ours, hf in ours_to_hf.items():
            names[f"decoder.layers.{i}.{ours}.weight"] = f"model.layers.{i}.{hf}.weight"
    return names


def _hf_config(weights: str, key: str, nested: str) -> tuple[dict, Path]:
    """The config.json beside a safetensors file; a LLaVA-style combined config nests the part."""
    if not weights:
        raise ConfigError(
            f"model.flavor='hf' reads the shapes from the checkpoints: set model.{key}"
        )
    path = Path(weights).parent / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.flavor='hf': {path} not found (the config.json beside model.{key})"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.flavor='hf': {path} is not JSON ({e})") from None
    return cfg.get(nested, cfg), path


def hf_flavor(vision_path: str, text_path: str) -> VLMArgs:
    """VLMArgs from Hugging Face configs: a SigLIP vision tower (every layer, then its
    post-layernorm) and a Llama-style decoder. What titan_vlm's modules cannot express is an error
    naming the config key, never an approximation."""
    v, v_path = _hf_config(vision_path, "hf_vision_path", "vision_config")
    t, t_path = _hf_config(text_path, "hf_text_path", "text_config")

    def need(cfg: dict, path: Path, key: str):
        if key not in cfg:
            raise ConfigError(f"model.flavor='hf': {path} has no '{key}'")
        return cfg[key]

    def refuse(path: Path, key: str, value, why: str) -> None:
        raise ConfigError(f"model.flavor='hf': {path}: {key}={value!r} is not supported ({why})")

    if "clip" in str(v.get("model_type", "")):
        refuse(
            v_path,
            "model_type",
            v["model_type"],
            "a CLIP tower has a class token and a pre-layernorm; titan_vlm's ViT is SigLIP-shaped",
        )
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu", "gelu_pytorch_tanh"):
        refuse(v_path, "hidden_act", act, "the ViT has gelu and gelu_pytorch_tanh")
    if t.get("hidden_act", "silu") != "silu":
        refuse(t_path, "hidden_act", t["hidden_act"], "the decoder's MLP is SwiGLU")
    for key in ("attention_bias", "mlp_bias"):
        if t.get(key):
            refuse(t_path, key, t[key], "the decoder's projections have no bias")
    if str(t.get("model_type", "")).startswith("qwen2"):
        refuse(t_path, "model_type", t["model_type"], "Qwen2 has q/k/v biases")
    if t.get("rope_scaling"):
        refuse(t_path, "rope_scaling", t["rope_scaling"], "plain RoPE only")
    dim, heads = need(t, t_path, "hidden_size"), need(t, t_path, "num_attention_heads")
    if t.get("head_dim") not in (None, dim // heads):
        refuse(
            t_path,
            "head_dim",
            t["head_dim"],
            f"head_dim must be hidden_size / num_attention_heads = {dim // heads}",
        )
    vision = ViTArgs(
        image_size=need(v, v_path, "image_size"),
        patch_size=need(v, v_path, "patch_size"),
        channels=v.get("num_channels", 3),
        dim=need(v, v_path, "hidden_size"),
        n_layers=need(v, v_path, "num_hidden_layers"),
        n_heads=need(v, v_path, "num_attention_heads"),
        mlp_dim=need(v, v_path, "intermediate_size"),
        norm_eps=v.get("layer_norm_eps", 1e-6),
        act=act,
    )
    decoder = DecoderArgs(
        dim=dim,
        n_layers=need(t, t_path, "num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=t.get("num_key_value_heads") or heads,
        ffn_dim=need(t, t_path, "intermediate_size"),
        vocab_size=need(t, t_path, "vocab_size"),
        rope_theta=t.get("rope_theta", 10000.0),
        norm_eps=t.get("rms_norm_eps", 1e-6),
        max_seq_len=t.get("max_position_embeddings", 4096),
    )
    return VLMArgs(vision=vision, decoder=decoder)


def _load_file(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise ConfigError(f"Hugging Face weights not found: {path}")
    return load_file(path)


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module, vision_path: str = "", text_path: str = ""
) -> list[str]:
    """Copy the named checkpoints into `model` (before any sharding). Returns the loaded names."""
    params = dict(model.named_parameters())
    loaded = []
    for path, names in (
        (vision_path, vision_names(len(model.vision.layers))),
        (text_path, text_names(len(model.decoder.layers))),
    ):
        if not path:
            continue
        hf = _load_file(path)
        if names.get("decoder.output.weight") == "lm_head.weight" and "lm_head.weight" not in hf:
            names["decoder.output.weight"] = "model.embed_tokens.weight"  # tied embeddings
        for ours, theirs in names.items():
            if theirs not in hf:
                raise ConfigError(f"{path}: tensor '{theirs}' not found (needed for {ours})")
            value = hf[theirs]
            target = params[ours]
            if value.shape != target.shape:
                raise ConfigError(
                    f"{path}: tensor '{theirs}' has shape {tuple(value.shape)}, "
                    f"{ours} needs {tuple(target.shape)} (check model.flavor)"
                )
            target.copy_(value.to(target.dtype))
            loaded.append(ours)
    return loaded


def save_hf_weights(model: torch.nn.Module, vision_path: str, text_path: str) -> None:
    """The inverse of `load_hf_weights`: write the model's weights under the public names."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    for path, names in (
        (vision_path, vision_names(len(model.vision.layers))),
        (text_path, text_names(len(model.decoder.layers))),
    ):
        out = {}
        for ours, theirs in names.items():
            value = params[ours].detach()
            out[theirs] = value.contiguous()
        save_file(out, path)
