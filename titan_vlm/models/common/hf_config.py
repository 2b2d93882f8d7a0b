"""Reading a Hugging Face config.json, shared by the families: `Section` (one dict of the file,
read with transformers' class defaults and worded errors) and the text model every family's
decoder is (`text_args_from_hf`: a Llama / Mistral / Qwen2 / Qwen3 config -> DecoderArgs).

`config` is the parsed config.json and `where` the file it came from (for the messages). Both the
spellings of transformers 4.x (top-level `rope_theta`, `rope_scaling` with "type" or "rope_type")
and 5.x (`rope_parameters` holding "rope_type", "rope_theta" and the scaling fields) are read. A
key that is absent takes the value transformers' config class gives it (its defaults differ per
family: Qwen3's head_dim is 128, Mistral's sliding_window 4096). Whatever the modules cannot
express is a ConfigError of one line naming the file and the key, never an approximation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from titan_vlm.errors import ConfigError
from titan_vlm.files import read_json
from titan_vlm.models.common.hf_folder import config_path
from titan_vlm.models.common.text_args import (
    ROPE_TYPES,
    DecoderArgs,
    MoEArgs,
    Rope,
    sparse_layers,
)

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig

A = TypeVar("A")  # a family's args

TEXT_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

# transformers' config-class defaults (the same in 4.57 and 5.24) for the keys read here.
TEXT_COMMON: dict[str, Any] = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)
# the sparse-layer keys whose defaults every Qwen3 MoE config class shares (5.25)
MOE_COMMON: dict[str, Any] = dict(
    decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001
)
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        TEXT_COMMON,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        vocab_size=32000,
        max_position_embeddings=2048,
        attention_bias=False,
        mlp_bias=False,
    ),
    "mistral": dict(
        TEXT_COMMON,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=131072,
        sliding_window=4096,
    ),
    "qwen2": dict(
        TEXT_COMMON,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        vocab_size=151936,
        max_position_embeddings=32768,
        use_sliding_window=False,
    ),
    "qwen3": dict(
        TEXT_COMMON,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        vocab_size=151936,
        max_position_embeddings=32768,
        head_dim=128,
        attention_bias=False,
        use_sliding_window=False,
    ),
    "qwen3_moe": dict(
        TEXT_COMMON,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=151936,
        max_position_embeddings=32768,
        attention_bias=False,
        use_sliding_window=False,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=False,
        **MOE_COMMON,
    ),
}
# Qwen3-VL-MoE's text model (Qwen3VLMoeTextConfig, 5.25): its router always renormalises
MOE_VL_DEFAULTS: dict[str, Any] = dict(
    moe_intermediate_size=1408, num_experts_per_tok=4, num_experts=60, **MOE_COMMON
)


@dataclass(frozen=True)
class Section:
    """One (possibly nested) dict of a config file: reads keys with the family's defaults and
    words errors as `<file>: <dotted key>...`."""

    cfg: dict
    where: str
    prefix: str  # "" or "text_config." ...
    defaults: dict[str, Any]

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def get(self, name: str) -> Any:
        """The value in the file; transformers' default when the key is absent (not when null:
        a null sliding_window means none)."""
        return self.cfg[name] if name in self.cfg else self.defaults.get(name)

    def get_int(self, name: str) -> int:
        value = self.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, value, "an integer is needed")
        return value

    def get_float(self, name: str) -> float:
        value = self.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(name, value, "a number is needed")
        return float(value)

    def get_bool(self, name: str) -> bool:
        value = self.get(name)
        if not isinstance(value, bool):
            raise self.error(name, value, "true or false is needed")
        return value

    def error(self, name: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{self.where}: {self.key(name)}={value!r} is not supported ({why})")

    def one_of(self, name: str, allowed: tuple[str, ...]) -> str:
        value = self.get(name)
        if value not in allowed:
            raise self.error(name, value, f"supported: {', '.join(allowed)}")
        return value

    def zero_dropout(self) -> None:
        if self.get_float("attention_dropout") != 0:
            raise self.error("attention_dropout", self.get("attention_dropout"), "no dropout")

    def sub(self, name: str, defaults: dict[str, Any]) -> Section:
        value = self.cfg.get(name)
        if not isinstance(value, dict):
            raise ConfigError(f"{self.where}: {self.key(name)} is missing or not an object")
        return Section(value, self.where, f"{self.key(name)}.", defaults)


def model_type_of(
    cfg: dict, where: str, prefix: str, supported: tuple[str, ...], default: str | None = None
) -> str:
    value = cfg.get("model_type", default)
    if value not in supported:
        raise ConfigError(
            f"{where}: {prefix}model_type={value!r} is not supported "
            f"(supported: {', '.join(supported)})"
        )
    return value


def _rope(s: Section) -> tuple[float, Rope]:
    """(rope_theta, scaling) from `rope_parameters` (5.x) or `rope_theta` + `rope_scaling` (4.x)."""
    params, scaling = s.cfg.get("rope_parameters"), s.cfg.get("rope_scaling")
    if params is not None and scaling is not None:
        raise s.error("rope_scaling", scaling, "give rope_parameters or rope_scaling, not both")
    section = "rope_parameters" if params is not None else "rope_scaling"
    fields = params if params is not None else scaling or {}
    if not isinstance(fields, dict):
        raise s.error(section, fields, "an object is needed")
    r = Section(fields, s.where, s.key(f"{section}."), {})
    theta = r.get_float("rope_theta") if "rope_theta" in fields else s.get_float("rope_theta")
    type_key = "rope_type" if "rope_type" in fields or "type" not in fields else "type"
    rope_type = fields.get(type_key, "default")
    if rope_type not in ROPE_TYPES:
        raise r.error(type_key, rope_type, f"supported rope types: {', '.join(ROPE_TYPES)}")
    for section_, name in ((r, "attention_factor"), (r, "partial_rotary_factor")):
        if section_.cfg.get(name) not in (None, 1, 1.0):
            raise section_.error(name, section_.cfg[name], "only 1 is supported")
    if s.cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise s.error(
            "partial_rotary_factor", s.cfg["partial_rotary_factor"], "only 1 is supported"
        )
    if rope_type == "default":
        return theta, Rope()
    if rope_type == "linear":
        return theta, Rope(type="linear", factor=_need(r, "factor"))
    low, high = _need(r, "low_freq_factor"), _need(r, "high_freq_factor")
    if high <= low:
        raise r.error("high_freq_factor", high, f"it must exceed low_freq_factor={low}")
    return theta, Rope(
        type="llama3",
        factor=_need(r, "factor"),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=int(_need(r, "original_max_position_embeddings")),
    )


def _need(s: Section, name: str) -> float:
    if s.cfg.get(name) is None:
        raise ConfigError(f"{s.where}: {s.key(name)} is missing")
    return s.get_float(name)


def text_args(s: Section, model_type: str) -> DecoderArgs:
    dim, heads = s.get_int("hidden_size"), s.get_int("num_attention_heads")
    kv_heads = s.get_int("num_key_value_heads") if s.get("num_key_value_heads") else heads
    if heads % kv_heads:
        raise s.error("num_key_value_heads", kv_heads, f"it must divide {heads} query heads")
    head_dim = s.get("head_dim") or dim // heads
    s.one_of("hidden_act", ("silu",))
    s.zero_dropout()
    max_len = s.get_int("max_position_embeddings")
    if model_type == "mistral":
        window = s.get("sliding_window")
        if window is not None and window < max_len:
            raise s.error(
                "sliding_window",
                window,
                f"sliding-window attention; null or >= max_position_embeddings={max_len} is",
            )
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if s.get_bool("use_sliding_window"):
            raise s.error("use_sliding_window", True, "sliding-window attention")
        types = s.cfg.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            raise s.error("layer_types", sorted(set(types)), "full_attention layers only")
    qwen3 = model_type in ("qwen3", "qwen3_moe")
    attention_bias = (model_type == "llama" or qwen3) and s.get_bool("attention_bias")
    theta, rope = _rope(s)
    return DecoderArgs(
        dim=dim,
        n_layers=s.get_int("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=s.get_int("intermediate_size"),
        vocab_size=s.get_int("vocab_size"),
        rope_theta=theta,
        norm_eps=s.get_float("rms_norm_eps"),
        max_seq_len=max_len,
        head_dim=head_dim,
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias,
        mlp_bias=model_type == "llama" and s.get_bool("mlp_bias"),
        qk_norm=qwen3,
        rope=rope,
        tie_embeddings=s.get_bool("tie_word_embeddings"),
        moe=moe_args(s, s.get_bool("norm_topk_prob")) if model_type == "qwen3_moe" else None,
    )


def text_args_from_hf(config: dict, where: str) -> DecoderArgs:
    """A LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM /
    Qwen3MoeForCausalLM config.json -> the decoder's args."""
    model_type = model_type_of(config, where, "", TEXT_TYPES)
    return text_args(Section(config, where, "", TEXT_DEFAULTS[model_type]), model_type)


def moe_args(s: Section, norm_topk_prob: bool) -> MoEArgs | None:
    """The sparse layers of a Qwen3-MoE text config (`num_experts`, which transformers 5 writes
    as `num_local_experts`; `num_experts_per_tok`, `moe_intermediate_size`,
    `decoder_sparse_step`, `mlp_only_layers`). The load-balancing loss's weight is what
    transformers' causal LM trains with: `router_aux_loss_coef` when `output_router_logits` is
    true, else 0 (training.moe_aux_loss_coef overrides it). None where no layer is sparse
    (num_experts 0, mlp_only_layers covering every layer, a sparse step past the last layer):
    transformers builds that model dense."""
    experts = "num_local_experts" if "num_local_experts" in s.cfg else "num_experts"
    if "num_experts" in s.cfg and s.cfg["num_experts"] != s.cfg.get(experts):
        raise s.error("num_experts", s.cfg["num_experts"], f"{experts}={s.cfg[experts]} differs")
    n_layers, step = s.get_int("num_hidden_layers"), s.get_int("decoder_sparse_step")
    if step < 1:
        raise s.error("decoder_sparse_step", step, "it must be at least 1")
    mlp_only = s.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise s.error("mlp_only_layers", mlp_only, "a list of layer indexes is needed")
    trains_aux = "output_router_logits" in s.cfg and s.get_bool("output_router_logits")
    layers = sparse_layers(n_layers, step, tuple(mlp_only))
    if s.get_int(experts) == 0 or not layers:
        return None
    try:
        return MoEArgs(
            num_experts=s.get_int(experts),
            top_k=s.get_int("num_experts_per_tok"),
            ffn_dim=s.get_int("moe_intermediate_size"),
            norm_topk_prob=norm_topk_prob,
            layers=layers,
            aux_loss_coef=s.get_float("router_aux_loss_coef") if trains_aux else 0.0,
        )
    except ConfigError as e:
        raise ConfigError(f"{s.where}: {s.prefix}{e}") from None


def with_moe_config(d: DecoderArgs, cfg: JobConfig) -> DecoderArgs:
    """`d` with the config's say over its experts (none without them): model.experts_kernel,
    and training.moe_aux_loss_coef as the load-balancing weight where it is set (>= 0)."""
    coef = cfg.training.moe_aux_loss_coef
    d = d.with_experts_kernel(cfg.model.experts_kernel)
    return d if coef < 0 else d.with_router_weight(coef)


def first_difference(a: object, b: object, prefix: str = "") -> str | None:
    """The first field (dotted) where two args dataclasses differ, or None."""
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            found = first_difference(x, y, f"{prefix}{f.name}.")
            if found:
                return found
        elif x != y:
            return f"{prefix}{f.name}: {x!r} vs {y!r}"
    return None


def whole_model_args(
    cfg: JobConfig,
    family: str,
    flavors: Mapping[str, A],
    from_config: Callable[[dict, str], A],
) -> A:
    """The architecture of a family whose model comes whole from one folder (Qwen-VL): with
    model.hf_path, its config.json's (`from_config`), which a built-in flavor must agree with
    (model.flavor = "hf" takes it as it is); without, the built-in flavor. Separate towers, an
    unknown flavor, or "hf" without a folder are one line."""
    m = cfg.model
    if m.hf_vision_path or m.hf_text_path:
        raise ConfigError(
            "model.hf_vision_path / hf_text_path: separate towers are the llava family's; a "
            f"{family} model comes whole from model.hf_path (or a built-in flavor)"
        )
    if m.flavor != "hf" and m.flavor not in flavors:
        raise ConfigError(
            f"model.flavor={m.flavor!r} is not a {family} flavor (known: {', '.join(flavors)}, hf)"
        )
    if not m.hf_path:
        if m.flavor == "hf":
            raise ConfigError("model.flavor='hf' reads the architecture from model.hf_path: set it")
        return flavors[m.flavor]
    path = config_path(Path(m.hf_path))
    args = from_config(read_json(path, "model.hf_path"), str(path))
    if m.flavor != "hf":
        diff = first_difference(flavors[m.flavor], args)
        if diff:
            raise ConfigError(
                f"model.flavor={m.flavor!r} does not match the config.json of {m.hf_path} "
                f"({diff}); set model.flavor = 'hf' to take the architecture from the folder"
            )
    return args
