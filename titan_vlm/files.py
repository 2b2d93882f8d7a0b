"""Reading the small JSON files of model folders (config.json, tokenizer_config.json, ...)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titan_vlm.errors import ConfigError


def read_json(path: Path, key: str) -> dict[str, Any]:
    """A JSON object from `path`; a missing or malformed file is one line naming it and `key`
    (the config key that led to it)."""
    if not path.is_file():
        raise ConfigError(f"{key}: {path} not found")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {path} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {path} must hold a JSON object")
    return value
