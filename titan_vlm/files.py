"""Reading the small files of model folders (config.json, tokenizer_config.json, a chat
template, ...): whatever is wrong with one (missing, a folder, unreadable, not UTF-8, not JSON) is
one line naming the file and the config key that led to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titan_vlm.errors import ConfigError


def cannot_read(key: str, path: Path, e: OSError) -> ConfigError:
    """The one-line error of a file that exists but cannot be read (permissions, I/O)."""
    return ConfigError(f"{key}: {path} cannot be read ({e.strerror or e})")


def _text(path: Path, key: str) -> str:
    """The text of `path` (UTF-8, universal newlines as open() reads it); missing, a folder or
    unreadable is a ConfigError; a UnicodeDecodeError is the caller's to word."""
    if path.is_dir():
        raise ConfigError(f"{key}: {path} is a folder, not a file")
    if not path.is_file():
        raise ConfigError(f"{key}: {path} not found")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise cannot_read(key, path, e) from None


def read_text(path: Path, key: str) -> str:
    """The UTF-8 text of `path`; a missing, unreadable or undecodable file, or a folder, is one
    line naming it and `key` (the config key that led to it)."""
    try:
        return _text(path, key)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {path} is not UTF-8 text ({e})") from None


def read_json(path: Path, key: str) -> dict[str, Any]:
    """A JSON object from `path`; a missing, unreadable or malformed file is one line naming it
    and `key` (the config key that led to it)."""
    try:
        value = json.loads(_text(path, key))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {path} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {path} must hold a JSON object")
    return value
