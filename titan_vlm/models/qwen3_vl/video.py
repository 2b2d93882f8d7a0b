"""Qwen3-VL's videos, as transformers 5.25's Qwen3VLVideoProcessor and Qwen3VLProcessor make them.

What differs from Qwen2.5-VL (models/common/qwen_vl/processor.py):

    sampling   a video file's frames: fps (2 by default) x its duration, within [min_frames,
               max_frames] and its frame count, at np.linspace(0, total - 1, n).round()
               (`Qwen3Sampling`); frame files the same, as a video of 24 frames a second
               (data/hf_processor.py kept_frame_files: what transformers assumes of frames
               given without metadata)
    size       every frame at one (H, W) chosen from the frames' size AND count (`video_size`:
               the frame count rounded to whole temporal patches counts against the pixel
               bounds; with cap_pixels_per_frame, each frame's share capped), so a video of
               few frames keeps more pixels a frame
    prompt     the chat template's <|vision_start|><|video_pad|><|vision_end|> collapses to the
               video, which becomes, for each frame group (temporal_patch_size frames), the
               group's time "<{t:.1f} seconds>" (the mean of its first and last frame's times;
               the last group padded with the last frame, as the pixels are) then the group's
               pad tokens between its own vision start / end tokens

    ... "<|im_start|>user\\n<0.2 seconds><|vision_start|>[group 0]<|vision_end|>
        <1.2 seconds><|vision_start|>[group 1]<|vision_end|>What happens?<|im_end|> ..."

So a video is one part per frame group (`Qwen3Vision.split_videos`): each is an image of grid
(1, h, w) to the tower (which attends within a frame anyway) and to M-RoPE (transformers'
get_rope_index splits a video's grid into t grids of t = 1 the same way), and the timestamps
are text, tokenized with the rest of the prompt as the processor tokenizes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from titan_vlm.data.batch import Part, VideoFrames
from titan_vlm.data.hf_processor import ChatError, Edit, HFProcessor
from titan_vlm.data.images import DEFAULT_FPS, VideoRef
from titan_vlm.models.common.qwen_vl.processor import (
    COMMON_DEFAULTS,
    FrameSampling,
    QwenVision,
    VideoClass,
    chat_processor,
    model_inputs,
    smart_resize,
)

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

# Qwen3VLVideoProcessor's class defaults (transformers 5.25)
VIDEO_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "patch_size": 16,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "max_video_tokens": 768,
}
SAMPLING_DEFAULTS: dict[str, Any] = {
    "do_sample_frames": True,
    "fps": 2,
    "num_frames": None,
    "min_frames": 4,
    "max_frames": 768,
}


class Qwen3Sampling(FrameSampling):
    """Which frames of a video Qwen3VLVideoProcessor keeps (its sample_frames): every frame
    without do_sample_frames; else num_frames, or by fps int(total / video_fps x fps) within
    [min_frames, max_frames] and the frame count (neither: the frame count within [min_frames,
    max_frames]); the indices np.linspace(0, total - 1, n).round(), an index repeated where n
    is more than the frames (as transformers repeats it)."""

    def indices(self, total: int, video_fps: float) -> list[int]:
        if not self.do_sample_frames:
            return list(range(total))
        if self.num_frames is not None:
            n = self.num_frames
        elif self.fps is not None:
            n = min(max(int(total / video_fps * self.fps), self.min_frames), self.max_frames, total)
        else:
            n = min(max(total, self.min_frames), self.max_frames)
        return np.linspace(0, total - 1, n).round().astype(int).tolist()


QWEN3_VIDEO = VideoClass(
    "Qwen3VLVideoProcessor",
    VIDEO_DEFAULTS,
    SAMPLING_DEFAULTS,
    Qwen3Sampling,
    caps_frames=True,
    reads_min_max_pixels=False,
)


def video_size(
    frames: int,
    height: int,
    width: int,
    factor: int,
    temporal: int,
    bounds: tuple[int, int],
    frame_cap: int | None,
) -> tuple[int, int]:
    """(H, W) of every frame of a video (Qwen3VLVideoProcessor.resize with its smart_resize): a
    side under `factor` first scaled up (both, int()) to reach it, then common/qwen_vl's
    smart_resize counting the frames (round(frames / temporal) x temporal of them against the
    video settings' (min_pixels, max_pixels) `bounds`); with `frame_cap` (cap_pixels_per_frame's
    max_video_tokens) max_pixels is frames x max(min(frame_cap x factor^2, max_pixels //
    frames), int(1.05 x min_pixels)). ValueError for fewer frames than `temporal`, or a size
    smart_resize refuses."""
    if frames < temporal:
        raise ValueError(f"a video of {frames} frame(s), fewer than temporal_patch_size {temporal}")
    low, high = bounds
    if frame_cap is not None:
        per_frame = max(min(frame_cap * factor * factor, high // frames), int(low * 1.05))
        high = per_frame * frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return smart_resize(height, width, factor, low, high, frames, temporal)


def group_times(times: tuple[float, ...], temporal: int) -> list[float]:
    """Each frame group's time (Qwen3VLProcessor._calculate_timestamps): the kept frames' times
    padded with the last to whole groups of `temporal`, each group's the mean of its first and
    last frame's."""
    padded = list(times) + [times[-1]] * (-len(times) % temporal)
    return [(padded[i] + padded[i + temporal - 1]) / 2 for i in range(0, len(padded), temporal)]


def frame_times(video: Part) -> tuple[float, ...]:
    """A video part's kept frames' times in seconds: a VideoRef's or a decoded video's own (their
    indices / the rate: a file's stream's, frame files' DEFAULT_FPS); a bare [T, C, H, W] tensor
    (frames given with no record of their choice) each frame's position / DEFAULT_FPS,
    transformers' rate for frames given without metadata."""
    if isinstance(video, VideoRef):
        return video.times()
    if isinstance(video, VideoFrames) and video.times:
        return video.times
    frames = video.frames if isinstance(video, VideoFrames) else video
    assert isinstance(frames, torch.Tensor), f"not a video: {video!r}"
    return tuple(i / DEFAULT_FPS for i in range(frames.shape[0]))


def frame_groups(video: Part, temporal: int) -> list[Part]:
    """A video part cut into its frame groups of `temporal` frames (the last may be shorter:
    the tower repeats its last frame, as transformers pads the video): a VideoRef into VideoRefs
    of the group's indices or frame files (the whole video's frame_size), decoded frames into
    their slices."""
    if isinstance(video, VideoRef):
        if video.frame_size is None:
            raise ValueError(f"{video.path}: a video's frame groups need its size (not read)")
        if video.is_file:
            ids = video.indices
            return [
                replace(video, indices=ids[i : i + temporal]) for i in range(0, len(ids), temporal)
            ]
        files, ids = video.frames, video.indices
        return [
            replace(
                video, path=files[i], frames=files[i : i + temporal], indices=ids[i : i + temporal]
            )
            for i in range(0, len(files), temporal)
        ]
    if isinstance(video, VideoFrames):
        n = video.frames.shape[0]
        return [
            VideoFrames(video.frames[i : i + temporal], video.fps, video.times[i : i + temporal])
            for i in range(0, n, temporal)
        ]
    assert isinstance(video, torch.Tensor)
    return list(video.split(temporal))


@dataclass(frozen=True)
class Qwen3Vision(QwenVision):
    """A Qwen3-VL folder's image half (QwenVision with Qwen3VLVideoProcessor's settings): a
    video's frames sized from their size and count (`video_size`), and cut into frame groups
    with their timestamps between them (`split_videos`, module docstring)."""

    splits_videos = True

    def video_size(self, height: int, width: int, frames: int) -> tuple[int, int]:
        v = self.processor.video
        if v.pixel_bounds is None:  # no resizing: the size must be whole merge units
            return v.resized(height, width)
        return video_size(
            frames,
            height,
            width,
            v.factor,
            v.temporal_patch_size,
            v.pixel_bounds,
            self.processor.frame_cap,
        )

    def split_videos(self, text: str, videos: list[Part]) -> tuple[list[Edit], list[Part]]:
        """Each video token of `text` (the chat template's vision start / video / vision end
        wrapper collapsed into it, as Qwen3VLProcessor collapses it) replaced by the video's
        frame groups, each its timestamp then one video token between the vision start / end
        tokens; the parts, each video's groups in order."""
        tokens = self.processor.tokens
        temporal = self.processor.video.temporal_patch_size
        wrapper = tokens.start + tokens.video + tokens.end
        found = list(re.finditer(f"{re.escape(wrapper)}|{re.escape(tokens.video)}", text))
        if len(found) != len(videos):
            raise ChatError(
                f"{len(found)} video token(s) {tokens.video!r} for {len(videos)} video(s)"
            )
        edits: list[Edit] = []
        parts: list[Part] = []
        for match, video in zip(found, videos):
            groups = frame_groups(video, temporal)
            times = group_times(frame_times(video), temporal)
            assert len(times) == len(groups)
            new = "".join(f"<{t:.1f} seconds>{wrapper}" for t in times)
            edits.append((match.start(), match.end(), new))
            parts += groups
        return edits, parts


def qwen3_chat_processor(path: str | Path) -> HFProcessor:
    """A Qwen3-VL folder's HFProcessor: common/qwen_vl's chat_processor with
    Qwen3VLVideoProcessor's settings and Qwen3Vision."""
    return chat_processor(path, QWEN3_VIDEO, Qwen3Vision)


def qwen3_inputs(cfg: JobConfig) -> tuple[ByteTokenizer | HFTokenizer, HFProcessor | None]:
    """The family's ModelSpec.inputs: the tokenizer and a Qwen3-VL folder's processor
    (common/qwen_vl model_inputs with `qwen3_chat_processor`)."""
    return model_inputs(cfg, qwen3_chat_processor)
