"""Qwen2.5-VL's input side: images and video frames as the ViT's flattened 3-D patches with their
(t, h, w) grids, and the prompt's `<|image_pad|>` / `<|video_pad|>` placeholders expanded to one
token per merged patch group, bit for bit what transformers 5's Qwen2_5_VLProcessor computes with
its PIL image processor (Qwen2VLImageProcessorPil: what AutoImageProcessor picks for a
Qwen2.5-VL folder where torchvision is not installed).

    proc = QwenVLProcessor.from_folder("Qwen2.5-VL-7B-Instruct")
    patches, grid = proc.preprocess_image("cat.png")  # [t*h*w, 3*2*14*14] float32, (1, h, w)
    patches, grid = proc.preprocess_frames(frames)    # frames: sampled PIL frames of one video
    proc.expand_prompt("<|vision_start|><|image_pad|><|vision_end|>Hi", [grid], [])

One image, step by step (`VisionSettings`): converted to RGB (transparency composited onto
white), resized with Pillow's `resample` filter to `smart_resize` of its size (both sides
multiples of patch_size * merge_size, the pixel count within [min_pixels, max_pixels]), rescaled
(x * rescale_factor in float64, then float32) and normalized ((x - mean) / std in float32), then
repeated to temporal_patch_size frames and cut into patches (`patchify`). A video is its frames
each processed the same way with the video settings, the last frame repeated up to a multiple of
temporal_patch_size, then cut into patches the same way.

Layout of `patchify` (transformers'): a patch is one row of C * T * P * P values in (channel,
frame, row, column) order; the rows run over t, then over merge groups (merge_size x merge_size
neighbouring patches, row-major over the (h / merge) x (w / merge) grid of groups), then over the
patches inside a group (row-major), so each merge_size^2 consecutive rows are the patches the
vision tower's merger concatenates into one token.

Files read (a folder as transformers writes it; a missing or malformed one is a one-line
ConfigError naming the file): the image settings from processor_config.json's "image_processor"
(transformers 5) or preprocessor_config.json; the video settings from processor_config.json's
"video_processor", else video_preprocessor_config.json, else preprocessor_config.json (the image
processor's file, read with the video processor's class defaults), as transformers'
Qwen2VLVideoProcessor loads them; tokenizer_config.json (and special_tokens_map.json) for the
placeholder token strings, tokenizer.json for their ids.

Video frames: transformers' only video processor for Qwen2.5-VL (Qwen2VLVideoProcessor) needs
torchvision and resizes with it (torch interpolation, fused rescale-and-normalize), so it cannot
run where the PIL backend runs. `preprocess_frames` processes each frame as the PIL image
processor processes an image (with the video settings) and lays the frames out as
Qwen2VLVideoProcessor.patchify does: the grid and the token counts are transformers' own, the
pixel values those of the PIL backend (they differ from torchvision's by up to a few 1e-2, as
images do). Decoding a video file and choosing its frames (do_sample_frames, fps, num_frames,
min_frames, max_frames) are the caller's: the frames given are the frames used.

A dataset file's conversations (data/jsonl.py): `chat_processor` is the folder's
data/hf_processor.py HFProcessor (its tokenizer and chat template, as for LLaVA) with this
family's image half, `QwenVision`: an image at its own size (images.py QwenRule.fit) as
`VisionSettings.pixels` [3, H, W], a video read whole, its frames at the size smart_resize gives
the frames' size with the video settings, stacked [T, 3, H, W], cut at `<|video_pad|>`.
`model_inputs` (ModelSpec.inputs) returns it for a folder with tokenizer and processor files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from titan_vlm.data.hf_processor import (
    KEY,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    FolderVision,
    HFProcessor,
)
from titan_vlm.data.images import DEFAULT_FPS, ImageProcessing, open_image
from titan_vlm.errors import ConfigError
from titan_vlm.files import read_json, read_text

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from titan_vlm.config import JobConfig
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

Grid = tuple[int, int, int]  # (t, h, w): frames / temporal_patch_size, patch rows, patch columns

IMAGE_TOKEN = "<|image_pad|>"  # Qwen2_5_VLProcessor's placeholders where the tokenizer names none
VIDEO_TOKEN = "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer / shorter side above this

# The class defaults transformers 5.25 gives settings a file leaves out: Qwen2VLImageProcessorPil
# and Qwen2VLVideoProcessor (they differ only in size: {min_pixels, max_pixels}).
COMMON_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "resample": 3,  # bicubic
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_std": OPENAI_CLIP_STD,
    "do_convert_rgb": True,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
IMAGE_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
}
VIDEO_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
}
IMAGE_CLASS = "Qwen2VLImageProcessor"  # with or without transformers' Pil / Fast suffix


def smart_resize(
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    frames: int = 1,
    temporal: int = 1,
) -> tuple[int, int]:
    """(H, W) transformers' Qwen2-VL smart_resize gives an image of height x width pixels: each
    side rounded to the nearest multiple of `factor` (Python's round: halves to even); where
    that has more than `max_pixels` pixels, both sides scaled by sqrt(max_pixels / (h * w)) and
    rounded DOWN to multiples (at least `factor`); where fewer than `min_pixels`, scaled by
    sqrt(min_pixels / (h * w)) and rounded UP. ValueError where the longer side is more than
    MAX_ASPECT_RATIO times the shorter (or a side is not positive). With `frames` (Qwen3-VL's
    video rule, models/qwen3_vl/video.py): the pixels compared are those of round(frames /
    `temporal`) x temporal frames, and the scale counts `frames` frames."""
    if height <= 0 or width <= 0:
        raise ValueError(f"an image of {width}x{height} pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
            f"{max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class VisionSettings:
    """One image or video processor's settings (see the module docstring for the steps).
    `pixel_bounds`: (min_pixels, max_pixels) of smart_resize, None where the processor does not
    resize (do_resize false: the image's sides must then already be multiples of `factor`);
    `rescale_factor` None: no rescaling; `mean` / `std` None: no normalization."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    pixel_bounds: tuple[int, int] | None
    resample: int  # a PIL filter number (PIL.Image.Resampling)
    convert_rgb: bool
    rescale_factor: float | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None

    @property
    def factor(self) -> int:
        """What both sides of every processed image are multiples of: patch_size * merge_size."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per patch row: 3 channels * temporal_patch_size * patch_size^2."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) pixels an image of height x width pixels is processed at. ValueError where
        smart_resize refuses it, or (no resizing) its sides are not multiples of `factor`."""
        if self.pixel_bounds is None:
            if height % self.factor or width % self.factor:
                raise ValueError(
                    f"an image of {width}x{height} pixels, and the processor does not resize "
                    f"(do_resize false): both sides must be multiples of {self.factor}"
                )
            return height, width
        return smart_resize(height, width, self.factor, *self.pixel_bounds)

    def grid(self, height: int, width: int, frames: int = 1) -> Grid:
        """The (t, h, w) grid of `frames` frames of height x width pixels (an image: 1 frame),
        from the sizes alone (no pixels decoded). t = ceil(frames / temporal_patch_size)."""
        if frames < 1:
            raise ValueError("a video of no frames")
        h, w = self.resized(height, width)
        return -(-frames // self.temporal_patch_size), h // self.patch_size, w // self.patch_size

    def tokens(self, grid: Grid) -> int:
        """Placeholder tokens of an image or video of this grid: t * h * w / merge_size^2."""
        t, h, w = grid
        return t * h * w // self.merge_size**2

    def pixels(self, image: PILImage.Image, size: tuple[int, int] | None = None) -> torch.Tensor:
        """One image (or frame) converted, resized, rescaled and normalized: float32 [3, H, W].
        `size`: the (H, W) to resize to (the frames of a video share their first frame's);
        default `resized` of the image's own size. ValueError for a non-RGB image where the
        settings do not convert (transformers cannot normalize it either)."""
        width, height = image.size
        target = self.resized(height, width) if size is None else size
        steps = ImageProcessing(
            convert_rgb=self.convert_rgb,
            shortest_edge=None,
            resize_to=target if self.pixel_bounds is not None else None,
            resample=self.resample,
            crop=None,
            rescale_factor=self.rescale_factor,
            mean=self.mean,
            std=self.std,
        )
        return steps(image)


def patchify(frames: torch.Tensor, settings: VisionSettings) -> tuple[torch.Tensor, Grid]:
    """Processed frames [N, C, H, W] (H, W multiples of settings.factor) as transformers lays
    them out (`patchify_frames` with the settings' patch, merge and temporal patch sizes)."""
    return patchify_frames(
        frames, settings.patch_size, settings.merge_size, settings.temporal_patch_size
    )


def patchify_frames(
    frames: torch.Tensor, patch: int, merge: int, temporal: int
) -> tuple[torch.Tensor, Grid]:
    """Frames [N, C, H, W] (H, W multiples of patch * merge) as transformers lays them out: the
    last frame repeated up to a multiple of `temporal`, then rows of [t * h * w, C * T * P * P]
    in the order of the module docstring, and the grid (t, h, w). A reshape and a permute: it
    runs wherever the frames are (the model patchifies on the device)."""
    n, c, height, width = frames.shape
    p, m, tp = patch, merge, temporal
    if height % (p * m) or width % (p * m):
        raise ValueError(f"frames of {width}x{height} pixels are not in whole {p * m}-pixel groups")
    if pad := -n % tp:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t, h, w = (n + pad) // tp, height // p, width // p
    grouped = frames.reshape(t, tp, c, h // m, m, p, w // m, m, p)
    # (t, groups down, groups across, row in group, column in group, C, T, P, P)
    grouped = grouped.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return grouped.reshape(t * h * w, c * tp * p * p).contiguous(), (t, h, w)


def preprocess_image(image: PILImage.Image, settings: VisionSettings) -> tuple[torch.Tensor, Grid]:
    """One image as transformers' pixel_values and image_grid_thw: float32 patches
    [h * w, 3 * T * P * P] (the image repeated to T = temporal_patch_size frames) and the grid
    (1, h, w) in patches."""
    pixels = settings.pixels(image)
    frames = pixels.unsqueeze(0).expand(settings.temporal_patch_size, -1, -1, -1)
    return patchify(frames, settings)


def preprocess_frames(
    frames: Sequence[PILImage.Image | np.ndarray], settings: VisionSettings
) -> tuple[torch.Tensor, Grid]:
    """The sampled frames of one video (PIL images, or uint8 [H, W, 3] RGB arrays as decoders
    give them), all of one size, as pixel_values_videos and video_grid_thw: float32 patches
    [t * h * w, 3 * T * P * P] and the grid (t, h, w), t = ceil(len(frames) / T) (an odd
    count: the last frame repeated). Every frame is resized to the size smart_resize gives the
    frames' size."""
    if not frames:
        raise ValueError("a video of no frames")
    images = [_as_image(frame) for frame in frames]
    sizes = {image.size for image in images}
    if len(sizes) != 1:
        raise ValueError(f"a video's frames must share one size, got {sorted(sizes)}")
    width, height = images[0].size
    size = settings.resized(height, width)
    return patchify(torch.stack([settings.pixels(image, size) for image in images]), settings)


def _as_image(frame: PILImage.Image | np.ndarray) -> PILImage.Image:
    """A frame as a PIL image: a uint8 [H, W, 3] array is read as RGB."""
    from PIL import Image

    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
            raise ValueError(
                f"a video frame must be a PIL image or a uint8 [H, W, 3] RGB array, got "
                f"{frame.dtype} {list(frame.shape)}"
            )
        return Image.fromarray(frame)  # uint8 [H, W, 3]: mode RGB
    if not isinstance(frame, Image.Image):
        raise ValueError(f"a video frame must be a PIL image or an array, got {type(frame)}")
    return frame


# Qwen2VLVideoProcessor's frame sampling defaults (transformers 5.25): no sampling (every frame)
SAMPLING_DEFAULTS: dict[str, Any] = {
    "do_sample_frames": False,
    "fps": None,
    "num_frames": None,
    "min_frames": 4,
    "max_frames": 768,
}


@dataclass(frozen=True)
class FrameSampling:
    """Which frames of a video file Qwen2VLVideoProcessor keeps (its sample_frames, with the
    folder's video settings: `frame_sampling`): every frame without do_sample_frames; else
    num_frames rounded to a multiple of temporal_patch_size, or, by fps, the video's duration
    x fps within [min_frames, max_frames] and the frame count, rounded down to a multiple of
    temporal_patch_size; the indices torch.arange(0, total, total / n) as int, as transformers
    takes them."""

    do_sample_frames: bool
    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int
    temporal_patch_size: int

    def indices(self, total: int, video_fps: float) -> list[int]:
        """The kept frames' indices of a video of `total` frames at `video_fps` (its header).
        ValueError where transformers' rule keeps none, or more than the video has."""
        if not self.do_sample_frames:
            return list(range(total))
        t = self.temporal_patch_size
        if self.num_frames is not None:
            n: float = round(self.num_frames / t) * t
        elif self.fps is not None:
            most = math.floor(min(self.max_frames, total) / t) * t
            n = min(max(total / video_fps * self.fps, self.min_frames), most, total)
            n = math.floor(n / t) * t
        else:
            return list(range(total))
        if n > total:
            raise ValueError(f"{n} frames to sample from a video of {total}")
        if n <= 0:
            raise ValueError(
                f"a video of {total} frames keeps none under the folder's frame sampling "
                f"(fps {self.fps}, temporal_patch_size {t})"
            )
        return torch.arange(0, total, total / n).int().tolist()


@dataclass(frozen=True)
class VideoClass:
    """A transformers video processor class a family's folders name (video_processor_type): its
    name, the defaults it gives settings a file leaves out (`defaults`: the VisionSettings keys;
    `sampling_defaults`: SAMPLING_DEFAULTS' keys), its frame sampling rule (a FrameSampling
    class), whether it may cap each frame's pixels (cap_pixels_per_frame) and whether it reads
    top-level min_pixels / max_pixels keys over its `size` (Qwen2-VL's does; Qwen3-VL's reads
    `size` alone)."""

    name: str
    defaults: dict[str, Any]
    sampling_defaults: dict[str, Any]
    sampling: type[FrameSampling] = FrameSampling
    caps_frames: bool = False
    reads_min_max_pixels: bool = True


QWEN2_VIDEO = VideoClass("Qwen2VLVideoProcessor", VIDEO_DEFAULTS, SAMPLING_DEFAULTS)


def frame_sampling(
    settings: dict[str, Any], where: str, temporal_patch_size: int, kind: VideoClass = QWEN2_VIDEO
) -> FrameSampling:
    """A video processor file's frame sampling settings over the class's defaults
    (kind.sampling_defaults; Qwen2-VL's SAMPLING_DEFAULTS) as kind.sampling; fps and num_frames
    together (transformers refuses them when it samples) or a value of the wrong kind is a
    one-line ConfigError naming `where` and the key."""
    defaults = kind.sampling_defaults
    s = {**defaults, **{k: v for k, v in settings.items() if k in defaults}}
    if not isinstance(s["do_sample_frames"], bool):
        raise ConfigError(
            f"{KEY}: {where}: do_sample_frames must be true or false, got {s['do_sample_frames']!r}"
        )
    for key in ("fps", "num_frames", "min_frames", "max_frames"):
        value = s[key]
        ok = value is None and key in ("fps", "num_frames")
        ok |= not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
        if not ok or (key != "fps" and value is not None and not isinstance(value, int)):
            raise ConfigError(f"{KEY}: {where}: {key} must be a positive number, got {value!r}")
    if s["do_sample_frames"] and s["fps"] is not None and s["num_frames"] is not None:
        raise ConfigError(
            f"{KEY}: {where}: fps and num_frames are both set (transformers takes one of them)"
        )
    return kind.sampling(
        s["do_sample_frames"],
        None if s["fps"] is None else float(s["fps"]),
        s["num_frames"],
        s["min_frames"],
        s["max_frames"],
        temporal_patch_size,
    )


def second_per_grid_t(fps: float, temporal_patch_size: int) -> float:
    """Seconds one temporal patch spans, as Qwen2_5_VLProcessor computes second_per_grid_ts:
    temporal_patch_size / fps, fps the frames' sampled rate (transformers' metadata.sampled_fps:
    sampled frames / total frames * the video's fps; DEFAULT_FPS for frames given without
    metadata). The model's M-RoPE reads it for video positions."""
    if fps <= 0:
        raise ValueError(f"a video sampled at {fps} frames per second")
    return temporal_patch_size / fps


@dataclass(frozen=True)
class VisionTokens:
    """The placeholder tokens and their ids: Qwen2_5_VLProcessor takes the strings from its
    tokenizer's `image_token` / `video_token` where the tokenizer names them, else IMAGE_TOKEN /
    VIDEO_TOKEN; Qwen3VLProcessor the vision start / end strings likewise (`start`, `end`: what
    it wraps each frame group of a video in)."""

    image: str
    video: str
    image_id: int
    video_id: int
    start: str = VISION_START
    end: str = VISION_END

    @classmethod
    def from_folder(cls, folder: str | Path) -> VisionTokens:
        """The tokens as transformers 5's tokenizer names them (tokenizer_config.json's
        "extra_special_tokens" dict over its top-level "image_token" / "video_token" strings;
        special_tokens_map.json, which transformers reads only where tokenizer_config.json has no
        "added_tokens_decoder": its "extra_special_tokens" dict over everything, its top-level
        keys under everything), with their ids in tokenizer.json (a token it lacks: ConfigError,
        where transformers would add it as a new token)."""
        from tokenizers import Tokenizer

        folder = Path(folder)
        config = read_json(folder / "tokenizer_config.json", KEY)
        legacy: dict[str, Any] = {}
        if "added_tokens_decoder" not in config and (folder / "special_tokens_map.json").is_file():
            legacy = read_json(folder / "special_tokens_map.json", KEY)
        defaults = {
            "image_token": IMAGE_TOKEN,
            "video_token": VIDEO_TOKEN,
            "vision_start_token": VISION_START,
            "vision_end_token": VISION_END,
        }
        names = {
            name: _token_name(name, default, config, legacy, folder)
            for name, default in defaults.items()
        }
        path = folder / "tokenizer.json"
        text = read_text(path, KEY)  # missing, a folder or unreadable: one line
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as e:  # the library's own parse errors
            raise ConfigError(f"{KEY}: {path} is not a tokenizer.json ({e})") from None
        ids = {}
        for name in ("image_token", "video_token"):  # the placeholders: their ids
            token = names[name]
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise ConfigError(f"{KEY}: {path}: the {name} {token!r} is not a token")
            ids[name] = token_id
        if ids["image_token"] == ids["video_token"]:
            raise ConfigError(
                f"{KEY}: {folder}: the image and video placeholders are one token "
                f"{names['image_token']!r}"
            )
        return cls(
            names["image_token"],
            names["video_token"],
            ids["image_token"],
            ids["video_token"],
            names["vision_start_token"],
            names["vision_end_token"],
        )


def _token_name(
    name: str, default: str, config: dict[str, Any], legacy: dict[str, Any], folder: Path
) -> str:
    """One placeholder's string as transformers 5's tokenizer loading ranks the files (see
    VisionTokens.from_folder). A top-level AddedToken dict counts in special_tokens_map.json
    only (transformers converts those; tokenizer_config.json's it ignores)."""
    top = legacy.get(name)
    if isinstance(top, dict) and isinstance(top.get("content"), str):
        top = top["content"]
    found = default
    for value in (  # lowest precedence first
        top,
        config.get(name),
        _named(config, name, folder / "tokenizer_config.json"),
        _named(legacy, name, folder / "special_tokens_map.json"),
    ):
        if isinstance(value, str):
            found = value
    return found


def _named(settings: dict[str, Any], name: str, path: Path) -> str | None:
    """`name` in the file's "extra_special_tokens" dict (None where it has no such dict or key);
    a value that is not a string is a ConfigError (transformers raises a TypeError)."""
    extra = settings.get("extra_special_tokens")
    if not isinstance(extra, dict) or name not in extra:
        return None
    if not isinstance(extra[name], str):
        raise ConfigError(f"{KEY}: {path}: extra_special_tokens.{name} must be a string")
    return extra[name]


def expand_prompt(
    text: str,
    image_grids: Sequence[Grid],
    video_grids: Sequence[Grid],
    tokens: VisionTokens,
    image_merge: int,
    video_merge: int,
) -> str:
    """`text` with its i-th image placeholder repeated t * h * w / image_merge^2 times
    (image_grids[i]), and likewise its videos, as Qwen2_5_VLProcessor rewrites a prompt before
    tokenizing it (left to right, the image token tried first where both match). ValueError
    where the placeholder counts differ from the grids' (transformers refuses them too)."""
    for kind, token, grids in (
        ("image", tokens.image, image_grids),
        ("video", tokens.video, video_grids),
    ):
        if text.count(token) != len(grids):
            raise ValueError(
                f"{text.count(token)} {token!r} placeholder(s) for {len(grids)} {kind}(s)"
            )
    groups = [f"(?P<image>{re.escape(tokens.image)})"] if image_grids else []
    groups += [f"(?P<video>{re.escape(tokens.video)})"] if video_grids else []
    if not groups:
        return text
    left = {"image": iter(image_grids), "video": iter(video_grids)}
    merges = {"image": image_merge, "video": video_merge}
    names = {"image": tokens.image, "video": tokens.video}

    def repeat(match: re.Match[str]) -> str:
        kind = str(match.lastgroup)
        return names[kind] * (math.prod(next(left[kind])) // merges[kind] ** 2)

    return re.sub("|".join(groups), repeat, text)


def expand_ids(
    ids: Sequence[int],
    image_grids: Sequence[Grid],
    video_grids: Sequence[Grid],
    tokens: VisionTokens,
    image_merge: int,
    video_merge: int,
) -> list[int]:
    """Token ids with each image / video placeholder id repeated as `expand_prompt` repeats the
    placeholder (the placeholders are special tokens, so tokenizing the expanded text gives the
    same ids). ValueError where the counts differ from the grids'."""
    ids = list(ids)
    kinds = {tokens.image_id: ("image", image_grids, image_merge)}
    kinds[tokens.video_id] = ("video", video_grids, video_merge)
    for token_id, (kind, grids, _) in kinds.items():
        if ids.count(token_id) != len(grids):
            raise ValueError(
                f"{ids.count(token_id)} {kind} placeholder id(s) {token_id} for "
                f"{len(grids)} {kind}(s)"
            )
    left = {token_id: iter(grids) for token_id, (_, grids, _) in kinds.items()}
    out: list[int] = []
    for token_id in ids:
        if token_id in kinds:
            merge = kinds[token_id][2]
            out += [token_id] * (math.prod(next(left[token_id])) // merge**2)
        else:
            out.append(token_id)
    return out


def vision_settings(
    settings: dict[str, Any], where: str, video: VideoClass | None
) -> VisionSettings:
    """A preprocessor file's settings (`video`: a video processor's, of that class, with its
    defaults; None: the image processor's) as transformers 5.25 reads them: the class defaults
    (IMAGE_DEFAULTS / video.defaults) for keys the file leaves out; the resize bounds from
    top-level min_pixels / max_pixels where present, else the file's `size` {"shortest_edge",
    "longest_edge"} (not merged with the default size: a file's size must name both). Anything
    transformers would refuse or this module does not do is a one-line ConfigError naming
    `where` and the key."""
    _check_class(settings, where, video)
    if video and not video.caps_frames and settings.get("cap_pixels_per_frame"):
        raise ConfigError(f"{KEY}: {where}: cap_pixels_per_frame=true is not supported")
    defaults = video.defaults if video else IMAGE_DEFAULTS
    s = {**defaults, **settings}
    flags = {}
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if not isinstance(s[key], bool):
            raise ConfigError(f"{KEY}: {where}: {key} must be true or false, got {s[key]!r}")
        flags[key] = s[key]
    resample = s["resample"]
    if isinstance(resample, bool) or resample not in range(6):
        raise ConfigError(
            f"{KEY}: {where}: resample must be a PIL filter number (0 to 5), got {resample!r}"
        )
    rescale = s["rescale_factor"]
    if flags["do_rescale"] and (isinstance(rescale, bool) or not isinstance(rescale, (int, float))):
        raise ConfigError(f"{KEY}: {where}: rescale_factor must be a number, got {rescale!r}")
    normalize = flags["do_normalize"]
    return VisionSettings(
        patch_size=_positive(s, "patch_size", where),
        temporal_patch_size=_positive(s, "temporal_patch_size", where),
        merge_size=_positive(s, "merge_size", where),
        pixel_bounds=(
            _pixel_bounds(s, defaults, where, not video or video.reads_min_max_pixels)
            if flags["do_resize"]
            else None
        ),
        resample=int(resample),
        convert_rgb=flags["do_convert_rgb"],
        rescale_factor=float(rescale) if flags["do_rescale"] else None,
        mean=_per_channel(s["image_mean"], "image_mean", where) if normalize else None,
        std=_per_channel(s["image_std"], "image_std", where) if normalize else None,
    )


def _check_class(settings: dict[str, Any], where: str, video: VideoClass | None) -> None:
    """The file's processor class, where it names one, must be Qwen2-VL's image processor, or
    the family's video processor class `video` (a video processor read from an image
    processor's file: transformers infers the video class from the model)."""
    if video and "video_processor_type" in settings:
        if settings["video_processor_type"] != video.name:
            raise ConfigError(
                f"{KEY}: {where}: video_processor_type {settings['video_processor_type']!r} is "
                f"not supported by this model family (supported: {video.name})"
            )
        return
    kind = settings.get("image_processor_type")
    if kind is not None and str(kind).removesuffix("Fast").removesuffix("Pil") != IMAGE_CLASS:
        raise ConfigError(
            f"{KEY}: {where}: image_processor_type {kind!r} is not supported "
            f"(supported: {IMAGE_CLASS})"
        )


def _positive(s: dict[str, Any], key: str, where: str) -> int:
    value = s[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{KEY}: {where}: {key} must be a positive integer, got {value!r}")
    return value


def _pixel_bounds(
    s: dict[str, Any], defaults: dict[str, Any], where: str, top_level: bool
) -> tuple[int, int]:
    """(min_pixels, max_pixels): the top-level keys (`top_level`: where the class reads them)
    over the size dict's (see vision_settings)."""
    size = s["size"]
    if size is None:  # transformers: a null size is the class default
        size = defaults["size"]
    if not isinstance(size, dict):
        raise ConfigError(
            f"{KEY}: {where}: size must be a dict {{shortest_edge, longest_edge}}, got {size!r}"
        )
    bounds = []
    for top, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        value = s[top] if top_level and s.get(top) is not None else size.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(
                f"{KEY}: {where}: no {top}: neither {top} nor size.{key} is a positive integer "
                f"(got {value!r})"
            )
        bounds.append(value)
    return bounds[0], bounds[1]


def _per_channel(value: Any, key: str, where: str) -> tuple[float, float, float]:
    """A mean or std: one number for all three channels, or three."""
    values = [value] * 3 if isinstance(value, (int, float)) else value
    if not (
        isinstance(values, (list, tuple))
        and len(values) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    ):
        raise ConfigError(f"{KEY}: {where}: {key} must be one number or three, got {value!r}")
    return float(values[0]), float(values[1]), float(values[2])


def _settings_file(
    folder: Path, processor: dict[str, Any], entry: str, files: tuple[str, ...]
) -> tuple[dict[str, Any], str]:
    """A processor's settings and where they came from: processor_config.json's `entry` dict
    (transformers 5 nests them there), else the first of `files` the folder has."""
    if isinstance(processor.get(entry), dict):
        return processor[entry], str(folder / "processor_config.json")
    for name in files:
        if (folder / name).is_file():
            return read_json(folder / name, KEY), str(folder / name)
    raise ConfigError(
        f"{KEY}: {folder}: no {entry.replace('_', ' ')} settings ({', '.join(files)}, or "
        f"processor_config.json with an {entry!r} entry)"
    )


@dataclass(frozen=True)
class QwenVLProcessor:
    """A Qwen2.5-VL folder's input side (see the module docstring): its image and video
    settings, its placeholder tokens."""

    folder: str
    image: VisionSettings
    video: VisionSettings
    tokens: VisionTokens
    image_file: str  # where the image settings came from, for errors
    video_file: str
    sampling: FrameSampling  # which frames of a video file are kept (the video settings')
    # cap_pixels_per_frame's per-frame token ceiling (max_video_tokens), None: no cap
    frame_cap: int | None = None

    @classmethod
    def from_folder(
        cls, path: str | Path, video_class: VideoClass = QWEN2_VIDEO
    ) -> QwenVLProcessor:
        """The folder's files (module docstring); the video settings as `video_class` reads
        them (the family's video processor: Qwen2-VL's by default)."""
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError(f"{KEY}: folder not found: {path}")
        processor: dict[str, Any] = {}
        if (folder / "processor_config.json").is_file():
            processor = read_json(folder / "processor_config.json", KEY)
        image, image_file = _settings_file(
            folder, processor, "image_processor", ("preprocessor_config.json",)
        )
        video, video_file = _settings_file(
            folder,
            processor,
            "video_processor",
            ("video_preprocessor_config.json", "preprocessor_config.json"),
        )
        video_settings = vision_settings(video, video_file, video_class)
        frame_cap = None
        if video_class.caps_frames and video.get("cap_pixels_per_frame"):
            frame_cap = video.get("max_video_tokens")
            if frame_cap is None:  # transformers: the class default
                frame_cap = video_class.defaults["max_video_tokens"]
            if isinstance(frame_cap, bool) or not isinstance(frame_cap, int) or frame_cap <= 0:
                raise ConfigError(
                    f"{KEY}: {video_file}: max_video_tokens must be a positive integer, got "
                    f"{frame_cap!r}"
                )
        return cls(
            folder=str(path),
            image=vision_settings(image, image_file, None),
            video=video_settings,
            tokens=VisionTokens.from_folder(folder),
            image_file=image_file,
            video_file=video_file,
            sampling=frame_sampling(
                video, video_file, video_settings.temporal_patch_size, video_class
            ),
            frame_cap=frame_cap,
        )

    def image_grid(self, path: str | Path, max_pixels: int | None = None) -> Grid:
        """The (1, h, w) grid of an image file, from its header alone (data/images.py
        open_image: ImageTooLarge above `max_pixels`; Pillow's errors pass through)."""
        with open_image(path, max_pixels) as img:
            width, height = img.size
        return self.image.grid(height, width)

    def preprocess_image(
        self, image: str | Path | PILImage.Image, max_pixels: int | None = None
    ) -> tuple[torch.Tensor, Grid]:
        """An image file (path) or PIL image as pixel_values [h * w, 3 * T * P * P] float32 and
        image_grid_thw (1, h, w). `max_pixels`: as data/images.py open_image (the file's size,
        before resizing)."""
        if isinstance(image, (str, Path)):
            with open_image(image, max_pixels) as img:
                return preprocess_image(img, self.image)
        return preprocess_image(image, self.image)

    def preprocess_frames(
        self, frames: Sequence[PILImage.Image | np.ndarray]
    ) -> tuple[torch.Tensor, Grid]:
        """One video's sampled frames as pixel_values_videos and video_grid_thw (module-level
        preprocess_frames with the video settings)."""
        return preprocess_frames(frames, self.video)

    def second_per_grid_t(self, fps: float = DEFAULT_FPS) -> float:
        """second_per_grid_ts of a video whose frames were sampled at `fps` (module-level
        second_per_grid_t with the video settings' temporal_patch_size)."""
        return second_per_grid_t(fps, self.video.temporal_patch_size)

    def expand_prompt(
        self, text: str, image_grids: Sequence[Grid], video_grids: Sequence[Grid] = ()
    ) -> str:
        """`text` as the processor expands it (module-level expand_prompt with the image and
        video settings' merge sizes)."""
        return expand_prompt(
            text,
            image_grids,
            video_grids,
            self.tokens,
            self.image.merge_size,
            self.video.merge_size,
        )

    def expand_ids(
        self, ids: Sequence[int], image_grids: Sequence[Grid], video_grids: Sequence[Grid] = ()
    ) -> list[int]:
        """Token ids with the placeholders expanded (module-level expand_ids)."""
        return expand_ids(
            ids, image_grids, video_grids, self.tokens, self.image.merge_size, self.video.merge_size
        )


@dataclass(frozen=True)
class QwenVision(FolderVision):
    """A Qwen2.5-VL folder's image half of data/hf_processor.py HFProcessor (module docstring):
    images keep their own sizes (image_size None), a video is one part at `video_token`."""

    processor: QwenVLProcessor
    video_token: str
    video_token_id: int

    def image(self, image: PILImage.Image, size: tuple[int, int] | None) -> torch.Tensor:
        """[3, H, W] float32 at `size` (None: smart_resize of its own size)."""
        return self.processor.image.pixels(image, size)

    def video(self, frames: list[PILImage.Image], size: tuple[int, int] | None) -> torch.Tensor:
        """[T, 3, H, W] float32, every frame at `size` (None: `video_size` of the frames' size
        and count), as preprocess_frames makes them before patchifying."""
        if size is None:
            width, height = frames[0].size
            size = self.video_size(height, width, len(frames))
        return torch.stack([self.processor.video.pixels(frame, size) for frame in frames])

    def video_size(self, height: int, width: int, frames: int) -> tuple[int, int]:
        """(H, W) each of a video's `frames` frames of height x width pixels is processed at:
        Qwen2VLVideoProcessor's smart_resize of one frame (the count does not matter)."""
        return self.processor.video.resized(height, width)

    def video_indices(self, frames: int, fps: float) -> list[int]:
        """The frames of a video file Qwen2VLVideoProcessor keeps (FrameSampling.indices with
        the folder's video settings)."""
        return self.processor.sampling.indices(frames, fps)


def has_processor_files(folder: Path) -> bool:
    """Whether a folder has image processor settings (preprocessor_config.json, or
    processor_config.json with an "image_processor" entry)."""
    if (folder / "preprocessor_config.json").is_file():
        return True
    path = folder / "processor_config.json"
    return path.is_file() and isinstance(read_json(path, KEY).get("image_processor"), dict)


def chat_processor(
    path: str | Path,
    video_class: VideoClass = QWEN2_VIDEO,
    vision: type[QwenVision] = QwenVision,
) -> HFProcessor:
    """A Qwen2.5-VL folder's HFProcessor (module docstring): its tokenizer with the image token
    as IMAGE, its chat template, `vision` (QwenVision; a family's own, with its `video_class`:
    Qwen3-VL's). config.json's image_token_id / video_token_id, where it has them, must be the
    tokenizer's ids of the placeholders (a ConfigError)."""
    from titan_vlm.data.tokenizer import HFTokenizer

    folder = Path(path)
    qwen = QwenVLProcessor.from_folder(folder, video_class)
    tokens = qwen.tokens
    tokenizer = HFTokenizer.from_folder(folder, tokens.image)
    if (folder / "config.json").is_file():
        config = read_json(folder / "config.json", KEY)
        for key, want in (("image_token_id", tokens.image_id), ("video_token_id", tokens.video_id)):
            if key in config and config[key] != want:
                raise ConfigError(
                    f"{KEY}: {folder}/config.json: {key}={config[key]} but the tokenizer's "
                    f"{tokens.image if key.startswith('image') else tokens.video!r} is id {want}"
                )
    settings: dict[str, Any] = {}
    if (folder / "processor_config.json").is_file():
        settings = read_json(folder / "processor_config.json", KEY)
    half = vision(qwen, tokens.video, tokens.video_id)
    return HFProcessor.with_vision(folder, settings, tokenizer, tokens.image, half)


def model_inputs(
    cfg: JobConfig, chat: Callable[[Path], HFProcessor] = chat_processor
) -> tuple[ByteTokenizer | HFTokenizer, HFProcessor | None]:
    """The tokenizer the job's text is encoded with and the folder's processor (ModelSpec.inputs):
    for model.hf_path with a tokenizer.json and processor settings (`has_processor_files`), its
    `chat` (the family's chat_processor: a dataset file's conversations in its chat template,
    images and videos as its processor makes them), else none. The tokenizer:
    model.tokenizer_path's; else the processor's; else model.hf_path's, as transformers loads
    it, where the folder has a tokenizer.json; else the built-in byte tokenizer."""
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

    m = cfg.model
    folder = Path(m.hf_path) if m.hf_path else None
    processor = None
    if folder and (folder / "tokenizer.json").is_file() and has_processor_files(folder):
        processor = chat(folder)
    if m.tokenizer_path:
        return build_tokenizer(m.tokenizer_path), processor
    if processor is not None:
        return processor.tokenizer, processor
    if folder and (folder / "tokenizer.json").is_file():
        return HFTokenizer.from_folder(folder), None
    return ByteTokenizer(), None
