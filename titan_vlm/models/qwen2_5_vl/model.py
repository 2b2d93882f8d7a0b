"""Qwen2.5-VL (`Qwen25VL`): the Qwen-VL model verbs (common/qwen_vl/model.py QwenVLModel) over
Qwen2.5-VL's windowed tower (vision.py) and a Qwen2 decoder with M-RoPE in three runs of
frequencies (MRopeDecoder). No parallelism in here."""

from __future__ import annotations

from pathlib import Path

from titan_vlm.files import read_json
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.model import MRopeDecoder, QwenVLModel
from titan_vlm.models.loading import load_whole_model
from titan_vlm.models.qwen2_5_vl.hf_adapter import hf_names, hf_same
from titan_vlm.models.qwen2_5_vl.hf_config import args_from_hf_config
from titan_vlm.models.qwen2_5_vl.vision import VisionTower


class Qwen25VL(QwenVLModel):
    """`vision` (the windowed tower + merger) and `decoder` (MRopeDecoder)."""

    vision: VisionTower

    def __init__(self, args: Qwen25VLArgs):
        super().__init__(args, VisionTower(args.vision, args.attention_kernel), MRopeDecoder(args))


def load_state_from_hf_folder(model: Qwen25VL, folder: Path) -> None:
    """Copy every parameter from a transformers-saved Qwen2.5-VL folder (hf_adapter names; a
    missing or stray tensor, or one of another shape, is a ConfigError). One process, no
    parallelism (models/loading.py load_whole_model)."""
    load_whole_model(model, folder, hf_names, hf_same)


def from_hf_folder(folder: Path) -> Qwen25VL:
    """The model of a transformers-saved folder: its config.json's args, its weights."""
    config = folder / "config.json"
    model = Qwen25VL(args_from_hf_config(read_json(config, str(folder)), str(config)))
    load_state_from_hf_folder(model, folder)
    return model
