"""Hugging Face tensor names of what families share: the Llama-shaped decoder's; and the rule
every family's mapping follows (`check_file_coverage`, `hf_tensor_parts`)."""

from __future__ import annotations

from collections.abc import Mapping

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.text_args import DecoderArgs


def decoder_hf_names(d: DecoderArgs, p: str, head: str) -> dict[str, str]:
    """{our parameter name: Hugging Face tensor name} of a Llama-shaped decoder
    (common/decoder.py, held as `decoder`) whose text model's tensors are under prefix `p`
    (model.*, language_model.model.*, ...) and whose untied head is `head`: transformers' names
    for Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE text models, in any family. A sparse layer's
    experts are named as common/hf_experts.py ExpertView stacks them."""
    names = {"decoder.tok_embeddings.weight": f"{p}embed_tokens.weight"}
    linears = {
        "attention.wq": ("self_attn.q_proj", d.qkv_bias),
        "attention.wk": ("self_attn.k_proj", d.qkv_bias),
        "attention.wv": ("self_attn.v_proj", d.qkv_bias),
        "attention.wo": ("self_attn.o_proj", d.o_bias),
        "feed_forward.w1": ("mlp.gate_proj", d.mlp_bias),
        "feed_forward.w3": ("mlp.up_proj", d.mlp_bias),
        "feed_forward.w2": ("mlp.down_proj", d.mlp_bias),
    }
    norms = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    if d.qk_norm:
        norms.update(
            {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
        )
    for i in range(d.n_layers):
        ours, hf = f"decoder.layers.{i}.", f"{p}layers.{i}."
        for name, (hf_name, bias) in linears.items():
            if i in d.sparse and name.startswith("feed_forward."):
                continue
            names[f"{ours}{name}.weight"] = f"{hf}{hf_name}.weight"
            if bias:
                names[f"{ours}{name}.bias"] = f"{hf}{hf_name}.bias"
        if i in d.sparse:  # the experts under hf_experts.py's stacked names, in any layout
            names[f"{ours}moe.router.weight"] = f"{hf}mlp.gate.weight"
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                names[f"{ours}moe.experts.{w}"] = f"{hf}mlp.experts.{proj}"
        for name, hf_name in norms.items():
            names[f"{ours}{name}.weight"] = f"{hf}{hf_name}.weight"
    names["decoder.norm.weight"] = f"{p}norm.weight"
    if not d.tie_embeddings:
        names["decoder.output.weight"] = head
    return names


def check_file_coverage(
    names: dict[str, str], unused: set[str], file_keys: set[str], where: str, style: str
) -> None:
    """Every family's loading rule: each mapped tensor (`names`: ours -> theirs) is in the
    files, and every tensor in the files is mapped or known to be unused; else a one-line
    ConfigError naming the first tensor (and how many more), the key style and `where`."""
    for ours, theirs in names.items():
        if theirs not in file_keys:
            raise ConfigError(f"{where}: tensor '{theirs}' not found (needed for {ours})")
    stray = sorted(file_keys - set(names.values()) - unused)
    if stray:
        more = f" and {len(stray) - 1} more" if len(stray) > 1 else ""
        raise ConfigError(
            f"{where}: tensor '{stray[0]}'{more} is not used by the model "
            f"(style {style}; check the config.json)"
        )


def hf_tensor_parts(names: Mapping[str, str]) -> dict[str, list[str]]:
    """{Hugging Face tensor: our parameters in it} of a mapping `names` (ours -> theirs). A tensor
    named by one parameter is that parameter; a tensor named by several (a fused tensor, e.g.
    Qwen2.5-VL's vision attn.qkv, our q, k and v) is their concatenation along dim 0, in the
    order `names` lists them: what loading reads each of them from (models/loading.py) and what
    an export writes (models/hf_export.py)."""
    parts: dict[str, list[str]] = {}
    for ours, theirs in names.items():
        parts.setdefault(theirs, []).append(ours)
    return parts
