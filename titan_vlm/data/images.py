"""Image files into the model's input: the one place training data and generate decode images.

Three preprocessings: `load_image` (the built-in models: SigLIP-style, square resize to the model's
size, values in [-1, 1]), `load_native_image` (the same, but each image keeps its aspect ratio at
a size `NativeResolution.fit` chooses: data.native_resolution_pixels > 0) and `ImageProcessing`
(a Hugging Face model folder's image processor settings, data/hf_processor.py), which computes
what transformers' PIL image processors compute. `VideoRef`: a video part before decoding, where
a family reads a video whole."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from math import ceil, floor, sqrt
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from titan_vlm.data.batch import ImageBytes, ImageRef
from titan_vlm.data.image_batch import ImageRule, Images, ImageSet

if TYPE_CHECKING:
    from PIL import Image as PILImage


# transformers' frames per second for a video given without metadata (frame files): its
# VideoMetadata.sampled_fps and Qwen3-VL's timestamps both take it
DEFAULT_FPS = 24.0


@dataclass(frozen=True)
class VideoRef(ImageRef):
    """A video part before decoding, where a folder's processor reads a video whole (one part,
    [T, 3, H, W] pixels once decoded; data/hf_processor.py FolderVision): `frames`, its kept
    frame files in order (`path` is the first); `frame_size`, the (H, W) each frame enters the
    encoder at (the family's ImageRule.fit of the frames' header size and count), None until
    read. `size` stays None, so that core code that counts an ImageRef's slots from one image's
    size (data/batch.py image_slots) refuses it instead of counting one frame: its slots are
    `rule.size_slots(*frame_size, len(frames))` (data/jsonl.py).

    A video FILE (`frames` empty, `path` the file: data/video.py) keeps, once its header is
    read, `indices`, the stream's frames the folder's processor keeps (its frame sampling), and
    `fps`, the rate they were sampled at (kept / total x the stream's rate: transformers'
    sampled_fps), and `rate`, the stream's own frames per second; its slots count `indices`.
    Frame files, once sized, likewise: `frames` the kept files, `indices` their places among
    the record's, `rate` DEFAULT_FPS (data/hf_processor.py kept_frame_files).

    A family that cuts a video into frame groups with text between them (Qwen3-VL's timestamps:
    FolderVision.split_videos) makes one VideoRef per group: the same file (or that group's
    frame files) with that group's `indices`, and the whole video's frame_size."""

    path: Path  # a video is a file (or frame files) beside the dataset file, never its bytes
    frames: tuple[Path, ...] = ()
    frame_size: tuple[int, int] | None = None
    indices: tuple[int, ...] = ()
    fps: float | None = None
    rate: float | None = None

    @property
    def is_file(self) -> bool:
        """A video file, not a list of frame files."""
        return not self.frames

    @property
    def num_frames(self) -> int:
        """The frames it keeps: the sampled ones of a file, else its frame files."""
        return len(self.indices) if self.is_file else len(self.frames)

    def times(self) -> tuple[float, ...]:
        """The kept frames' times in seconds: each index / the rate (a file's stream's; frame
        files', DEFAULT_FPS: data/hf_processor.py kept_frame_files)."""
        assert self.rate is not None, "a video whose frames were not chosen"
        return tuple(i / self.rate for i in self.indices)


class ImageTooLarge(ValueError):
    """An image file whose header says it has more pixels than allowed (nothing was decoded)."""


@contextmanager
def open_image(
    path: str | Path | ImageBytes, max_pixels: int | None = None
) -> Iterator[PILImage.Image]:
    """The image file (or a dataset file's image bytes), opened lazily (pixels not yet decoded).
    `max_pixels`: raise ImageTooLarge, from the header alone, for an image with more pixels.
    Pillow's own errors (a missing, truncated or corrupt file) pass through."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(path.data) if isinstance(path, ImageBytes) else path)
    except Image.DecompressionBombError as e:  # Pillow's own bound (2 x Image.MAX_IMAGE_PIXELS)
        raise ImageTooLarge(str(e)) from None
    except UnidentifiedImageError as e:  # bytes: named as a file would be, not "<_io.BytesIO>"
        if isinstance(path, ImageBytes):
            raise UnidentifiedImageError(f"cannot identify image file {path.name!r}") from None
        raise e
    with img:
        width, height = img.size  # from the header; pixels are decoded lazily
        if max_pixels is not None and width * height > max_pixels:
            raise ImageTooLarge(
                f"image of {width}x{height} pixels is larger than "
                f"data.max_image_pixels={max_pixels}"
            )
        yield img


def load_image(
    path: str | Path | ImageBytes, size: int, max_pixels: int | None = None
) -> torch.Tensor:
    """An image file as a [3, size, size] tensor in [-1, 1] (SigLIP's normalisation, mean 0.5 and
    std 0.5 per channel): converted to RGB, resized to size x size with bicubic resampling (the
    aspect ratio is not kept, as SigLIP's own preprocessing does).

    `max_pixels`: raise ImageTooLarge, from the header alone, for an image with more pixels.
    Pillow's own errors (a missing, truncated or corrupt file) pass through."""
    from PIL import Image

    with open_image(path, max_pixels) as img:
        rgb = img.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BICUBIC)
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return pixels.permute(2, 0, 1).float() / 255 * 2 - 1


@dataclass(frozen=True)
class NativeResolution(ImageRule):
    """data.native_resolution_pixels = `max_pixels` > 0: each image keeps its aspect ratio and
    enters the ViT at `fit(height, width)`, a grid of whole `patch_size`-pixel patches, and takes
    `image_tokens(h, w)` slots (VLMArgs.image_tokens: the data's, the batch's and the model's one
    rule). `image_size`: the ViT's native square side (its learned position grid), the unit of
    the CP cost model's ViT work (`native_patches`)."""

    max_pixels: int
    patch_size: int
    image_size: int
    image_tokens: Callable[[int, int], int]

    def fit(self, height: int, width: int, frames: int = 0) -> tuple[int, int]:
        """(H, W) for an image (a video's frames are images) of height x width pixels: the
        aspect ratio kept, scaled by
        s = min(1, sqrt(max_pixels / (height * width))), each side rounded DOWN to a multiple of
        the patch size and at least one patch. So H * W <= max_pixels always (a side clamped to
        one patch takes the other side's room: the other is cut to max_pixels // patch^2
        patches), an image is never upscaled except to reach one patch per side, and one that
        already fits is only cut down to whole patches (unlike Qwen2-VL's smart_resize, which
        rounds to the nearest multiple and upscales to a minimum)."""
        p, n = self.patch_size, self.max_pixels
        if n < p * p:
            raise ValueError(f"data.native_resolution_pixels={n} is less than one {p}x{p} patch")
        s = min(1.0, sqrt(n / (height * width)))
        rows, cols = max(1, floor(height * s / p)), max(1, floor(width * s / p))
        most = n // (p * p)  # patches an image may have
        if rows * cols > most:  # only a side clamped to one patch can overshoot
            rows, cols = (1, min(cols, most)) if rows == 1 else (min(rows, most), 1)
        return rows * p, cols * p

    def patches(self, height: int, width: int) -> int:
        """Patches of an image that enters the ViT at height x width pixels."""
        return (height // self.patch_size) * (width // self.patch_size)

    @property
    def native_patches(self) -> int:
        """Patches of an image at the ViT's native square size (the ViT-work unit)."""
        return self.patches(self.image_size, self.image_size)

    def size_of(
        self, path: str | Path | ImageBytes, max_pixels: int | None = None
    ) -> tuple[int, int]:
        """(H, W) the image file enters the ViT at, from its header alone (`open_image`:
        ImageTooLarge above `max_pixels`, Pillow's errors pass through)."""
        with open_image(path, max_pixels) as img:
            width, height = img.size
        return self.fit(height, width)

    def slots(self, image: torch.Tensor) -> int:
        """The slots of a decoded [C, H, W] image (`image_tokens` of its size)."""
        return self.image_tokens(image.shape[-2], image.shape[-1])

    def size_slots(self, height: int, width: int, frames: int = 1) -> int:
        if frames != 1:
            raise ValueError("native resolution: one image a part (a video is its frames)")
        return self.image_tokens(height, width)

    def batch(self, images: list[torch.Tensor]) -> Images:
        """One [n, 3, S, S] tensor when every image has the native size S (none: [0, 3, S, S]),
        else an ImageList."""
        s = self.image_size
        if all(p.shape[1:] == (s, s) for p in images):
            return torch.stack(images) if images else torch.zeros(0, 3, s, s)
        return ImageList(tuple(images), self)


@dataclass(frozen=True)
class ImageList(ImageSet):
    """A batch's images when they are not all at the model's native square size
    (data.native_resolution_pixels > 0): `tensors`, each [C, h, w] (h, w multiples of the patch
    size), in batch order (rows in order, each in reading order). Never empty: an empty
    selection is the empty [0, C, S, S] tensor of the fixed-size path (`__getitem__`).
    `native`: the geometry they were fitted by; its native patch count is the unit of
    `work`."""

    tensors: tuple[torch.Tensor, ...]
    native: NativeResolution

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("ImageList: no images (an empty batch is a [0, C, S, S] tensor)")

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, index: slice) -> Images:
        """The images `index` selects, in order; none: an empty [0, C, S, S] tensor (S the
        native size) on their device."""
        picked = self.tensors[index]
        if picked:
            return ImageList(picked, self.native)
        first, s = self.tensors[0], self.native.image_size
        return first.new_zeros((0, first.shape[0], s, s))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ImageList:
        return ImageList(
            tuple(t.to(device, non_blocking=non_blocking) for t in self.tensors), self.native
        )

    def pin_memory(self) -> ImageList:
        return ImageList(tuple(t.pin_memory() for t in self.tensors), self.native)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def sizes(self) -> list[tuple[int, int]]:
        """(height, width) of each image, in order."""
        return [(t.shape[1], t.shape[2]) for t in self.tensors]

    def slots(self) -> list[int]:
        return [self.native.image_tokens(h, w) for h, w in self.sizes()]

    def patches(self) -> list[int]:
        return [self.native.patches(h, w) for h, w in self.sizes()]

    def work(self) -> list[float]:
        return [n / self.native.native_patches for n in self.patches()]


def load_native_image(
    path: str | Path | ImageBytes, native: NativeResolution, max_pixels: int | None = None
) -> torch.Tensor:
    """An image file as a [3, H, W] tensor in [-1, 1] (as `load_image`), at (H, W) =
    `native.fit` of its size: its aspect ratio kept, resized with bicubic resampling (not at
    all when it already has that size)."""
    from PIL import Image

    with open_image(path, max_pixels) as img:
        height, width = native.fit(img.size[1], img.size[0])
        rgb = img.convert("RGB")
        if rgb.size != (width, height):
            rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(height, width, 3).permute(2, 0, 1).float() / 255 * 2 - 1


@dataclass(frozen=True)
class ImageProcessing:
    """What transformers' PIL-backend image processors do to one image (CLIPImageProcessor and
    SiglipImageProcessor; transformers 5 uses that backend where torchvision is not installed),
    step by step in their order, each step skipped when its setting is None:

    1. `convert_rgb`: transparency composited onto white, then RGB (uint8);
    2. resize with Pillow's `resample` filter: `shortest_edge` (the short side to that length,
       the long side to int(shortest_edge * long / short)), or `resize_to` (height, width);
    3. `crop` (height, width): a center crop (top and left rounded down; zero padding where the
       image is smaller);
    4. `rescale_factor`: x * factor in float64, then float32;
    5. `mean` / `std` per channel: (x - mean) / std in float32.

    The result is a float32 [3, H, W] tensor, bit for bit transformers' pixel_values."""

    convert_rgb: bool
    shortest_edge: int | None
    resize_to: tuple[int, int] | None
    resample: int
    crop: tuple[int, int] | None
    rescale_factor: float | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, or None where it follows the image's aspect ratio."""
        return self.crop or self.resize_to

    def __call__(self, image: PILImage.Image) -> torch.Tensor:
        from PIL import Image

        if self.convert_rgb:
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                image = Image.alpha_composite(white, rgba).convert("RGB")
            else:
                image = image.convert("RGB")
        if image.mode != "RGB":
            raise ValueError(
                f"a {image.mode} image, and the image processor does not convert to RGB"
            )
        if self.shortest_edge is not None:
            w, h = image.size
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(self.shortest_edge * long / short)
            size = (self.shortest_edge, new_long) if w <= h else (new_long, self.shortest_edge)
            image = image.resize(size, Image.Resampling(self.resample))
        elif self.resize_to is not None:
            image = image.resize(self.resize_to[::-1], Image.Resampling(self.resample))
        pixels = np.array(image).transpose(2, 0, 1)  # [3, H, W] uint8
        if self.crop is not None:
            pixels = center_crop(pixels, *self.crop)
        if self.rescale_factor is not None:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return torch.from_numpy(np.ascontiguousarray(pixels))


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The [C, height, width] center of [C, H, W] pixels (top and left offsets rounded down), the
    image zero-padded first (half each side, the extra pixel before) where it is smaller."""
    _, h, w = pixels.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
    top_pad, left_pad = ceil((new_h - h) / 2), ceil((new_w - w) / 2)
    padded[:, top_pad : top_pad + h, left_pad : left_pad + w] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[
        :, max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)
    ]
