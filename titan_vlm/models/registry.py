"""The one registry of model families: `model.name` -> its `ModelSpec` (models/spec.py)."""

from __future__ import annotations

from titan_vlm.errors import ConfigError
from titan_vlm.models.llava import LLAVA
from titan_vlm.models.spec import ModelSpec

MODEL_SPECS: dict[str, ModelSpec] = {LLAVA.name: LLAVA}


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODEL_SPECS:
        known = ", ".join(MODEL_SPECS)
        raise ConfigError(f"model.name: unknown model family {name!r} (known: {known})")
    return MODEL_SPECS[name]
