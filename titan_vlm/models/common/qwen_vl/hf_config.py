"""What the Qwen-VL families' config.json readers share: the text model's rope dict with its
M-RoPE sections (`split_mrope`), and where a file keeps them, for messages (`mrope_key`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_vlm.models.common.hf_config import Section


def split_mrope(s: Section, default: tuple[int, ...]) -> tuple[Section, tuple[int, ...]]:
    """The text section with its rope dict read as common/hf_config.py reads a Qwen2's (the
    sections taken out, "mrope" named "default" as transformers renames it), and the sections."""
    cfg = dict(s.cfg)
    section: Any = list(default)
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        rope = dict(rope)
        if "mrope_section" in rope:
            section = rope.pop("mrope_section")
        for type_key in ("rope_type", "type"):
            if rope.get(type_key) == "mrope":
                rope[type_key] = "default"
        cfg[key] = rope
    if not (
        isinstance(section, (list, tuple))
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in section)
    ):
        raise s.error(mrope_key(s), section, "a list of positive integers is needed")
    return replace(s, cfg=cfg), tuple(section)


def mrope_key(s: Section) -> str:
    """Where the file keeps mrope_section (for messages)."""
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(s.cfg.get(key), dict):
            return f"{key}.mrope_section"
    return "rope_parameters.mrope_section"
