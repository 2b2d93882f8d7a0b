"""Video files (data/video.py) and Qwen2.5-VL's frame sampling (models/common/qwen_vl/processor.py
FrameSampling) against transformers: the header and the decoded frames equal
transformers.video_utils.read_video_pyav's on an mp4 written here; the kept frames equal
Qwen2VLVideoProcessor.sample_frames (compiled from transformers' source: the class needs
torchvision to be built) over durations, rates and settings; a header without a frame count
(mkv, webm) has its packets counted; a damaged file and a missing PyAV are one line."""

from __future__ import annotations

import ast
import math
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_qwen2_5_vl_processor import hf_video_class, hf_video_defaults

from titan_vlm.data.video import VideoError, decode_video, probe_video
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl import processor as qp
from titan_vlm.models.common.qwen_vl.processor import FrameSampling, frame_sampling

av = pytest.importorskip("av")
video_utils = pytest.importorskip("transformers.video_utils")


def write_mp4(
    path: Path, frames: int, fps: int = 4, width: int = 84, height: int = 56, codec: str = "mpeg4"
) -> Path:
    """A video file of `frames` noise frames at `fps`, its container by the path's suffix
    (lossy: both readers decode the same file, so they must agree bit for bit all the same)."""
    container = av.open(str(path), "w")
    stream = container.add_stream(codec, rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    rng = np.random.default_rng(0)
    for _ in range(frames):
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return path


def test_header_and_frames_equal_transformers_pyav_reader(tmp_path):
    path = write_mp4(tmp_path / "clip.mp4", 13, fps=4)
    info = probe_video(path)
    indices = [0, 3, 4, 12]
    theirs, meta = video_utils.read_video_pyav(
        str(path), sample_indices_fn=lambda metadata, **_: np.array(indices)
    )
    assert (info.frames, info.fps, info.height, info.width) == (
        meta.total_num_frames,
        meta.fps,
        meta.height,
        meta.width,
    )
    ours = decode_video(path, indices)
    assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    assert not np.array_equal(ours[0], ours[1])  # the control: frames differ


@pytest.mark.parametrize("name, codec", [("clip.mkv", "mpeg4"), ("clip.webm", "libvpx")])
def test_a_header_without_a_frame_count_has_its_packets_counted(tmp_path, name, codec):
    """Matroska / WebM headers say no frame count: the count is the stream's packets (what
    torchcodec's scan counts), which is the frames PyAV decodes; the frames are transformers'
    PyAV reader's at the same indices."""
    path = write_mp4(tmp_path / name, 13, fps=4, codec=codec)
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0  # the case
        decoded = sum(1 for _ in container.decode(video=0))
    info = probe_video(path)
    assert (info.frames, info.fps, info.height, info.width) == (decoded, 4.0, 56, 84)
    indices = [0, 6, 12]
    theirs, _ = video_utils.read_video_pyav(
        str(path), sample_indices_fn=lambda metadata, **_: np.array(indices)
    )
    ours = decode_video(path, indices)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_damaged_files_are_one_line(tmp_path, monkeypatch):
    good = write_mp4(tmp_path / "clip.mp4", 13).read_bytes()
    (tmp_path / "cut.mp4").write_bytes(good[: len(good) // 3])
    (tmp_path / "text.mp4").write_text("not a video")
    for name in ("cut.mp4", "text.mp4", "missing.mp4"):
        with pytest.raises(VideoError) as e:
            decode_video(tmp_path / name, list(range(13)))
        assert "\n" not in str(e.value) and name in str(e.value)
    with pytest.raises(VideoError, match="asked for"):  # fewer frames than the header says
        decode_video(tmp_path / "clip.mp4", [0, 20])
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    with pytest.raises(ConfigError, match=r"pip install 'titan_vlm\[video\]'"):
        probe_video(tmp_path / "clip.mp4")


@cache
def _sample_frames_source():
    """Qwen2VLVideoProcessor.sample_frames compiled from transformers' source file."""
    fn = next(
        n
        for n in hf_video_class().body
        if isinstance(n, ast.FunctionDef) and n.name == "sample_frames"
    )
    namespace: dict = {"torch": torch, "math": math, "VideoMetadata": object}
    fn.returns = None  # its annotations name transformers' types
    for arg in fn.args.args + fn.args.kwonlyargs:
        arg.annotation = None
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "sample_frames", "exec"), namespace)
    return namespace["sample_frames"]


def transformers_sample_frames(settings: FrameSampling, total: int, video_fps: float) -> list[int]:
    """Qwen2VLVideoProcessor.sample_frames from transformers' source, on a stand-in `self` with
    the settings' attributes."""
    me = SimpleNamespace(
        num_frames=settings.num_frames,
        fps=settings.fps,
        temporal_patch_size=settings.temporal_patch_size,
        min_frames=settings.min_frames,
        max_frames=settings.max_frames,
    )
    meta = SimpleNamespace(total_num_frames=total, fps=video_fps)
    return _sample_frames_source()(me, meta).tolist()


def test_sampling_equals_transformers_sample_frames():
    checked = refused = 0
    for total in (1, 2, 3, 7, 13, 48, 300, 1001):
        for video_fps in (1.0, 4.0, 23.976, 30.0):
            for fps, num in ((2.0, None), (0.5, None), (7.0, None), (None, 4), (None, 5)):
                for low, high, t in ((4, 768, 2), (1, 6, 2), (2, 9, 3), (4, 768, 1)):
                    s = FrameSampling(True, fps, num, low, high, t)
                    try:
                        want = transformers_sample_frames(s, total, video_fps)
                    except (ValueError, ZeroDivisionError):
                        with pytest.raises(ValueError):
                            s.indices(total, video_fps)
                        refused += 1
                        continue
                    assert s.indices(total, video_fps) == want, (total, video_fps, s)
                    checked += 1
    assert checked > 400 and refused > 20


def test_sampling_settings_and_their_defaults():
    defaults = hf_video_defaults()
    for key in ("do_sample_frames", "min_frames", "max_frames"):
        assert qp.SAMPLING_DEFAULTS[key] == defaults[key], key
    off = frame_sampling({}, "f.json", 2)  # transformers' default: every frame
    assert off.indices(9, 30.0) == list(range(9))
    on = frame_sampling({"do_sample_frames": True, "fps": 2}, "f.json", 2)
    assert on.indices(90, 30.0) == transformers_sample_frames(on, 90, 30.0)
    for bad, message in (
        ({"do_sample_frames": True, "fps": 2, "num_frames": 8}, "fps and num_frames"),
        ({"fps": "2"}, "fps must be a positive number"),
        ({"min_frames": 1.5}, "min_frames must be a positive number"),
        ({"do_sample_frames": "yes"}, "do_sample_frames must be true or false"),
    ):
        with pytest.raises(ConfigError, match=message):
            frame_sampling(bad, "f.json", 2)


def test_a_video_file_needs_a_processor_that_reads_videos_whole(tmp_path):
    """A record's video file on a model whose processor takes a video as its frames (LLaVA, the
    built-in data): a bad sample in one line, naming the file and what to give instead."""
    from titan_vlm.data.records import BadSample, parse_record
    from titan_vlm.data.tokenizer import ByteTokenizer

    record = {"video": "clip.mp4", "text": "A dot <video> moves."}
    with pytest.raises(BadSample) as e:
        parse_record(record, ByteTokenizer(), tmp_path, check_files=False)
    assert e.value.kind == "bad record" and "clip.mp4" in str(e.value)
    assert "list of frame files" in str(e.value) and "\n" not in str(e.value)
