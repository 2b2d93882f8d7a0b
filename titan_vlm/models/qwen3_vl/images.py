"""Qwen3-VL's images and videos in a batch: Qwen2.5-VL's rule (models/common/qwen_vl/images.py
QwenRule: native resolution, smart_resize with the folder's bounds, each sample's M-RoPE
positions), with Qwen3VLVideoProcessor's video sizing (video.py video_size: from the frames'
size and count).

A video reaches the batch as its frame groups (video.py: the processor writes each group's
timestamp between them), each a part of at most temporal_patch_size frames, positioned as an
image of grid (1, h, w), as transformers' get_rope_index positions a Qwen3-VL video. A longer
video part would be positioned as one Qwen2.5-VL video, which is not what Qwen3-VL computes:
`positions` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_vlm.data.batch import Sample, VideoFrames
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.images import QwenRule
from titan_vlm.models.common.qwen_vl.processor import QwenVLProcessor
from titan_vlm.models.qwen3_vl.video import VIDEO_DEFAULTS, video_size


@dataclass(frozen=True)
class Qwen3Rule(QwenRule):
    """QwenRule with Qwen3-VL's video sizing: `video_bounds` the video processor's (min_pixels,
    max_pixels) over a whole video's frames, `frame_cap` its cap_pixels_per_frame token
    ceiling (None: no cap)."""

    video_bounds: tuple[int, int] | None = (
        VIDEO_DEFAULTS["size"]["shortest_edge"],
        VIDEO_DEFAULTS["size"]["longest_edge"],
    )
    frame_cap: int | None = None

    @classmethod
    def from_processor(cls, args: Qwen25VLArgs, proc: QwenVLProcessor) -> Qwen3Rule:
        return cls(
            args,
            proc.image.pixel_bounds,
            video_bounds=proc.video.pixel_bounds,
            frame_cap=proc.frame_cap,
        )

    def fit(self, height: int, width: int, frames: int = 0) -> tuple[int, int]:
        """An image's size as QwenRule's; a video's `frames` frames' by video.py video_size
        (QwenRule's where the processor does not resize)."""
        if not frames or self.video_bounds is None:
            return super().fit(height, width, frames)
        v = self.args.vision
        unit = v.patch_size * v.spatial_merge_size
        return video_size(
            frames, height, width, unit, v.temporal_patch_size, self.video_bounds, self.frame_cap
        )

    def positions(self, sample: Sample) -> dict[str, torch.Tensor]:
        """QwenRule's positions, every video part one frame group (module docstring)."""
        temporal = self.args.vision.temporal_patch_size
        for part in sample.parts:
            frames = part.frames if isinstance(part, VideoFrames) else part
            if isinstance(frames, torch.Tensor) and frames.ndim == 4 and len(frames) > temporal:
                raise ValueError(
                    f"a Qwen3-VL video part of {len(frames)} frames: a video enters a sample as "
                    f"its frame groups of {temporal} (models/qwen3_vl/video.py)"
                )
        return super().positions(sample)
