"""Video files (mp4, webm, mkv, mov, avi: what FFmpeg opens), read with PyAV, the optional extra
`pip install 'titan_vlm[video]'`, as transformers' pyav backend reads them
(transformers.video_utils.read_video_pyav):

    info = probe_video(path)             from the container's header: the video stream's frame
                                         count (`frames`) and rate (`average_rate`), its height
                                         and width; nothing decoded
    frames = decode_video(path, [0, 5])  the frames at those indices (increasing), decoded in
                                         order from the start as RGB uint8 [H, W, 3] arrays

Matroska and WebM files (.mkv, .webm) carry no frame count in their header: their frames are
counted once by reading the stream's packets without decoding them (`count_packets`), as
transformers' default reader (torchcodec, seek_mode="exact") counts them by its scan (its PyAV
reader takes the header's 0 and fails). The count is the one frames are sampled from; should a
stream decode to fewer frames than an index asked for, decode_video says so (VideoError).

Which frames a model keeps (and so the rate they were sampled at) is the family's rule (e.g.
models/common/qwen_vl/processor.py FrameSampling, from the folder's video processor settings).
Anything PyAV cannot open or decode, a stream without frames or a header without a rate, is a
VideoError naming the file; without PyAV, a ConfigError saying how to install it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from titan_vlm.errors import ConfigError


class VideoError(ValueError):
    """A video file that cannot be opened, has no usable header, or cannot be decoded."""


@dataclass(frozen=True)
class VideoInfo:
    """A video stream's header: its frame count, rate (frames per second) and frame size."""

    frames: int
    fps: float
    height: int
    width: int


def _av(path: str | Path) -> ModuleType:
    try:
        import av
    except ImportError:
        raise ConfigError(
            f"{path} is a video file: decoding it needs PyAV (pip install 'titan_vlm[video]')"
        ) from None
    return av


def _open(path: str | Path) -> Any:
    av = _av(path)
    try:
        container = av.open(str(path))
    except (OSError, av.error.FFmpegError) as e:
        raise VideoError(f"{path}: cannot be opened as a video ({type(e).__name__}: {e})") from None
    if not container.streams.video:
        container.close()
        raise VideoError(f"{path}: has no video stream")
    return container


def probe_video(path: str | Path) -> VideoInfo:
    """The first video stream's header (nothing decoded); where it gives no frame count (mkv,
    webm), the count of its packets (`count_packets`). VideoError where the stream has no frames
    or the header no rate."""
    with _open(path) as container:
        stream = container.streams.video[0]
        frames, rate = int(stream.frames), stream.average_rate
        height, width = int(stream.height), int(stream.width)
        if frames <= 0 and rate:
            frames = count_packets(path, container)
    if frames <= 0 or not rate:
        raise VideoError(
            f"{path}: its video stream has no frames or its header no rate (frames={frames}, "
            f"average_rate={rate}); re-encode it (e.g. ffmpeg -i IN -c:v libx264 OUT.mp4)"
        )
    return VideoInfo(frames, float(rate), height, width)


def count_packets(path: str | Path, container: Any) -> int:
    """The first video stream's frames, counted as its packets that hold data and are not marked
    discard (read, not decoded: one frame each, as torchcodec counts them when it scans a file;
    transformers' default reader takes that count). VideoError where reading fails."""
    av = _av(path)
    try:
        return sum(1 for p in container.demux(video=0) if p.size and not p.is_discard)
    except av.error.FFmpegError as e:
        raise VideoError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def decode_video(path: str | Path, indices: Sequence[int]) -> list[np.ndarray]:
    """The frames at `indices` (increasing, within the header's count) as RGB uint8 [H, W, 3],
    decoded in stream order from the first frame, stopping after the last index; an index given
    twice (a sampling rule that asks for more frames than the video has) gives its frame twice.
    VideoError where decoding fails or the stream ends before an index."""
    if not indices:
        raise VideoError(f"{path}: no frames asked for")
    wanted, last = set(indices), indices[-1]
    frames: dict[int, np.ndarray] = {}
    av = _av(path)
    with _open(path) as container:
        try:
            for i, frame in enumerate(container.decode(video=0)):
                if i > last:
                    break
                if i in wanted:
                    frames[i] = frame.to_ndarray(format="rgb24")
        except av.error.FFmpegError as e:
            raise VideoError(f"{path}: cannot be decoded ({type(e).__name__}: {e})") from None
    if len(frames) != len(wanted):
        raise VideoError(
            f"{path}: the stream ended after {len(frames)} of the {len(wanted)} frames asked for "
            "(its header's frame count is wrong, or the file is truncated)"
        )
    return [frames[i] for i in indices]
