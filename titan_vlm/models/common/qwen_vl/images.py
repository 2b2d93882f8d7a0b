"""Qwen2.5-VL's images and videos in a batch (data/image_batch.py ImageRule and ImageSet).

A decoded image part is its processed pixels, float32 [C, H, W] (converted, smart_resized,
rescaled and normalized: processor.py VisionSettings.pixels), a video's its frames
[T, C, H, W] at one size; H and W are multiples of patch * merge. The grid (t, h, w) follows from
the shape alone, t = ceil(frames / temporal_patch_size) (an image is one frame, repeated to
temporal_patch_size frames as transformers repeats it), and so do its slots, t * h * w / merge^2,
and its patches. The patches transformers' processor lays out (processor.py patchify_frames)
are made on the device, in encode_images: a reshape and a permute of these pixels.

    QwenRule     how they take slots (from a decoded part, or from the size a file header's size
                 enters at: `fit`, the processor's smart_resize), how a batch holds them
                 (QwenVisuals), and each sample's M-RoPE positions [3, slots] (`positions`: the
                 family's per-slot data, Batch.slot_data); `folder_rule`: the rule with a model
                 folder's processor bounds
    QwenVisuals  a batch's images and videos in batch order; its `work` is its tower cost in
                 units of one patch's matmuls (attention included)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from titan_vlm.data.batch import Sample, VideoFrames
from titan_vlm.data.image_batch import ImageRule, Images, ImageSet
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.mrope import Grid, vision_positions
from titan_vlm.models.common.qwen_vl.processor import (
    DEFAULT_FPS,
    KEY,
    QWEN2_VIDEO,
    VIDEO_DEFAULTS,
    QwenVLProcessor,
    VideoClass,
    has_processor_files,
    smart_resize,
)
from titan_vlm.models.common.qwen_vl.vision_cost import image_train_flops, vision_patch_flops

# Batch.slot_data key of the rows' M-RoPE positions [3, B, S] (the model reads the local slots'
# [3, B, L] from SeqLayout.slot_data under the same key)
MROPE_POSITIONS = "mrope_positions"


@dataclass(frozen=True)
class QwenRule(ImageRule):
    """`args`: the model's (patch, merge and temporal patch sizes, tokens_per_second);
    `pixel_bounds` / `video_bounds`: smart_resize's (min_pixels, max_pixels) for images / a
    video's frames sized from file headers (the folder's image and video processor settings;
    None: the processor does not resize, a size must already be whole merge units); `fps`: the
    rate a video's frames were sampled at where the part does not say (frames given as files
    carry none: transformers' default, processor.DEFAULT_FPS; a decoded video file, VideoFrames,
    carries its own)."""

    args: Qwen25VLArgs
    pixel_bounds: tuple[int, int] | None = (56 * 56, 28 * 28 * 1280)
    fps: float = DEFAULT_FPS
    video_bounds: tuple[int, int] | None = (
        VIDEO_DEFAULTS["size"]["shortest_edge"],
        VIDEO_DEFAULTS["size"]["longest_edge"],
    )

    @classmethod
    def from_processor(cls, args: Qwen25VLArgs, proc: QwenVLProcessor) -> QwenRule:
        """The rule with a folder's processor's image and video pixel bounds."""
        return cls(args, proc.image.pixel_bounds, video_bounds=proc.video.pixel_bounds)

    @property
    def image_size(self) -> int:  # type: ignore[override]
        """The side of the built-in data's square images (Qwen25VLArgs.image_size)."""
        return self.args.image_size

    def grid(self, image: torch.Tensor) -> Grid:
        """(t, h, w) in patches of a decoded image [C, H, W] or video [T, C, H, W]."""
        v = self.args.vision
        frames = 1 if image.ndim == 3 else image.shape[0]
        height, width = image.shape[-2:]
        unit = v.patch_size * v.spatial_merge_size
        if height % unit or width % unit:
            raise ValueError(f"an image of {width}x{height} pixels is not whole {unit}-pixel units")
        t = -(-frames // v.temporal_patch_size)
        return t, height // v.patch_size, width // v.patch_size

    def slots(self, image: torch.Tensor) -> int:
        return self.args.vision.tokens(*self.grid(image))

    def fit(self, height: int, width: int, frames: int = 0) -> tuple[int, int]:
        """(H, W) an image (`frames` > 0: a video's frames) of height x width pixels is
        processed at: smart_resize with the image (video) bounds, as the folder's processor
        (processor.py VisionSettings.resized). ValueError where smart_resize refuses it, or
        (no resizing) a side is not whole merge units."""
        v = self.args.vision
        unit = v.patch_size * v.spatial_merge_size
        bounds = self.video_bounds if frames else self.pixel_bounds
        if bounds is None:
            if height % unit or width % unit:
                raise ValueError(
                    f"an image of {width}x{height} pixels, and the processor does not resize: "
                    f"both sides must be multiples of {unit}"
                )
            return height, width
        return smart_resize(height, width, unit, *bounds)

    def size_slots(self, height: int, width: int, frames: int = 1) -> int:
        """Slots of an image (frames > 1: a video of that many frames) that enters the tower at
        height x width pixels (`fit` of its header's size): its merged grid's tokens."""
        v = self.args.vision
        unit = v.patch_size * v.spatial_merge_size
        if height % unit or width % unit:
            raise ValueError(f"an image of {width}x{height} pixels is not whole {unit}-pixel units")
        t = -(-frames // v.temporal_patch_size)
        return v.tokens(t, height // v.patch_size, width // v.patch_size)

    def batch(self, images: list[torch.Tensor]) -> Images:
        device = images[0].device if images else torch.device("cpu")
        return QwenVisuals(tuple(images), self, device)

    def seconds_per_grid_t(self, fps: float | None = None) -> float:
        """Seconds one temporal patch of a video spans: temporal_patch_size / fps, the rate its
        frames were sampled at (None: `fps`, frame files' default)."""
        return self.args.vision.temporal_patch_size / (fps or self.fps)

    def positions(self, sample: Sample) -> dict[str, torch.Tensor]:
        """The sample's M-RoPE positions [3, its slots] (mrope.py's rule, from its parts: text
        advances all three, an image or video takes its merged grid's (t, h, w) from where the
        text is, text resumes after the largest), under MROPE_POSITIONS: collate's SlotData."""
        a = self.args
        out: list[torch.Tensor] = []
        pos = 0
        for part in sample.parts:
            if isinstance(part, list):
                out.append((torch.arange(len(part)) + pos).expand(3, -1))
                pos += len(part)
                continue
            if isinstance(part, VideoFrames):  # a video file: the rate its frames were kept at
                fps, part = part.fps, part.frames
            elif isinstance(part, torch.Tensor):
                fps = self.fps
            else:
                raise TypeError(f"an image that was not decoded ({part!r})")
            video = part.ndim == 4
            interval = a.tokens_per_second * self.seconds_per_grid_t(fps) if video else 1
            block = vision_positions(pos, self.grid(part), a.vision.spatial_merge_size, interval)
            out.append(block)
            pos = int(block.max()) + 1
        positions = torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)
        return {MROPE_POSITIONS: positions}


def folder_rule(
    args: Qwen25VLArgs,
    hf_path: str,
    kind: type[QwenRule] = QwenRule,
    video_class: VideoClass = QWEN2_VIDEO,
) -> QwenRule:
    """The QwenRule (of class `kind`: a family's own, e.g. Qwen3-VL's, with its video processor
    class) of a model folder: its processor's image and video settings where the folder has
    processor files (processor.py has_processor_files: `kind.from_processor`), else the class
    defaults. A processor whose patch, merge or temporal patch size is not the model's is a
    ConfigError naming its file."""
    if not (hf_path and has_processor_files(Path(hf_path))):
        return kind(args)
    proc = QwenVLProcessor.from_folder(hf_path, video_class)
    v = args.vision
    for settings, where in ((proc.image, proc.image_file), (proc.video, proc.video_file)):
        ours = (settings.patch_size, settings.merge_size, settings.temporal_patch_size)
        model = (v.patch_size, v.spatial_merge_size, v.temporal_patch_size)
        if ours != model:
            raise ConfigError(
                f"{KEY}: {where}: patch_size, merge_size, temporal_patch_size {ours}, the "
                f"model's config.json has {model}"
            )
    return kind.from_processor(args, proc)


@dataclass(frozen=True)
class QwenVisuals(ImageSet):
    """A batch's decoded images ([C, H, W]) and videos ([T, C, H, W]) in batch order (module
    docstring), possibly none (a CP rank's empty share). `work` is in units of one patch's
    matmuls (the family's LayoutCost.image: flops.py), attention included."""

    tensors: tuple[torch.Tensor, ...]
    rule: QwenRule
    where: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, index: slice) -> QwenVisuals:
        return QwenVisuals(self.tensors[index], self.rule, self.where)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QwenVisuals:
        return QwenVisuals(
            tuple(t.to(device, non_blocking=non_blocking) for t in self.tensors),
            self.rule,
            torch.device(device),
        )

    def pin_memory(self) -> QwenVisuals:
        return QwenVisuals(tuple(t.pin_memory() for t in self.tensors), self.rule, self.where)

    @property
    def device(self) -> torch.device:
        return self.where

    def grids(self) -> list[Grid]:
        return [self.rule.grid(t) for t in self.tensors]

    def sizes(self) -> list[tuple[int, int]]:
        return [(t.shape[-2], t.shape[-1]) for t in self.tensors]

    def slots(self) -> list[int]:
        return [self.rule.args.vision.tokens(*g) for g in self.grids()]

    def patches(self) -> list[int]:
        """What cp_vision = "shard" balances: each image's tower cost (`work`), rounded."""
        return [round(w) for w in self.work()]

    def work(self) -> list[float]:
        """Each image's tower cost (vision_cost.image_train_flops: its patches' matmuls and its
        window and full attention as they are) in units of one patch's matmuls, what the
        family's LayoutCost.image prices."""
        a = self.rule.args
        unit = vision_patch_flops(a.vision)
        return [image_train_flops(a, g) / unit for g in self.grids()]

    def units(self) -> QwenVisuals:
        """Images whole, each video cut into its frame groups ([temporal_patch_size, C, H, W],
        the last one shorter where the frames do not fill it): the tower attends within a frame
        group (its full-attention blocks over one group's patches, its windows inside one
        group, the same 2-D rotary positions in every group), and patchify_frames repeats a
        short group's last frame as it repeats the video's, so encoding the groups one by one
        gives the video's rows in order. A video's embeddings are then the concatenation of
        its groups' (ImageSet.units; tests/unit/test_qwen2_5_vl_family.py checks it against
        the whole video)."""
        step = self.rule.args.vision.temporal_patch_size
        pieces: list[torch.Tensor] = []
        for t in self.tensors:
            if t.ndim == 4 and t.shape[0] > step:
                pieces += list(t.split(step))
            else:
                pieces.append(t)
        return QwenVisuals(tuple(pieces), self.rule, self.where)
