"""The one registry of model families: a family's name -> its `ModelSpec` (models/spec.py).

Which family a config trains (`model_spec`): with model.flavor = "hf" and model.hf_path set, the
`model_type` of the folder's config.json (each family lists the model types it reads,
ModelSpec.hf_model_types); otherwise model.name. Adding a family is a folder
(models/<model_type>/) and one line here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from titan_vlm.errors import ConfigError
from titan_vlm.files import read_json
from titan_vlm.models.common.hf_folder import config_path
from titan_vlm.models.llava.spec import LLAVA
from titan_vlm.models.qwen2_5_vl.spec import QWEN2_5_VL
from titan_vlm.models.qwen3_vl.spec import QWEN3_VL
from titan_vlm.models.spec import ModelSpec

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAVA, QWEN2_5_VL, QWEN3_VL)}


def get_model_spec(name: str) -> ModelSpec:
    """The family called `name` (model.name)."""
    if name not in MODEL_SPECS:
        known = ", ".join(MODEL_SPECS)
        raise ConfigError(f"model.name: unknown model family {name!r} (known: {known})")
    return MODEL_SPECS[name]


def family_name(cfg: JobConfig) -> str:
    """The family `cfg` trains: the folder's model_type under model.flavor = "hf" (with
    model.hf_path), else model.name. A model_type no family reads is a one-line ConfigError
    naming the file and the families."""
    m = cfg.model
    if m.flavor != "hf" or not m.hf_path:
        return m.name
    path = config_path(Path(m.hf_path))
    model_type = read_json(path, "model.hf_path").get("model_type")
    for spec in MODEL_SPECS.values():
        if model_type in spec.hf_model_types:
            return spec.name
    known = "; ".join(f"{s.name}: {', '.join(s.hf_model_types)}" for s in MODEL_SPECS.values())
    raise ConfigError(
        f"model.hf_path: {path}: model_type={model_type!r} is not a family titan_vlm trains "
        f"(model types by family: {known})"
    )


def model_spec(cfg: JobConfig) -> ModelSpec:
    """The ModelSpec of the family `cfg` trains (`family_name`)."""
    return get_model_spec(family_name(cfg))
