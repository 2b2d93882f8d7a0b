"""Qwen3-VL's images in a batch: Qwen2.5-VL's rule (models/common/qwen_vl/images.py QwenRule: native
resolution, smart_resize with the folder's bounds, each sample's M-RoPE positions), for images.

Videos are refused in one line (`NO_VIDEO`): Qwen3-VL's processor writes each frame group's
timestamp into the text ("<1.0 seconds>") and wraps every frame group in its own vision start /
end tokens, and its positions restart per frame group; that path is not built yet, and
Qwen2.5-VL's would compute something else. The refusal is a UserError, not a bad sample: no
video is ever skipped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_vlm.data.batch import Sample, VideoFrames
from titan_vlm.errors import UserError
from titan_vlm.models.common.qwen_vl.images import QwenRule

NO_VIDEO = (
    "data.dataset: a record holds a video, and the qwen3_vl family does not train on videos yet "
    "(Qwen3-VL's frame timestamps are not built); use images, or a qwen2_5_vl model"
)


@dataclass(frozen=True)
class Qwen3Rule(QwenRule):
    """QwenRule for images; any video is a one-line UserError (module docstring)."""

    def fit(self, height: int, width: int, video: bool = False) -> tuple[int, int]:
        if video:
            raise UserError(NO_VIDEO)
        return super().fit(height, width)

    def positions(self, sample: Sample) -> dict[str, torch.Tensor]:
        for part in sample.parts:
            if isinstance(part, VideoFrames) or (isinstance(part, torch.Tensor) and part.ndim == 4):
                raise UserError(NO_VIDEO)
        return super().positions(sample)
