"""A batch's images as core code sees them, and how a family's images take slots.

    Images      one [n, C, S, S] tensor of images at the model's native square size S (n may be
                0), or an ImageSet: images of their own sizes (data/images.py ImageList), or a
                family's own preprocessed form (Qwen2.5-VL's frames and grids)
    ImageRule   how images of their own sizes take slots, are batched, and what per-slot data a
                sample's images give its slots (a SlotRule that is not one number: LLaVA's
                data.native_resolution_pixels, a Qwen-VL processor's resize rule)

CP (parallel/context_parallel.py), the batch checks, the cost model and the metrics read only
what is here; a family's encode_images reads the rest. Nothing here names a family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class ImageSet(ABC):
    """A batch's images when they are not one [n, C, S, S] tensor of the model's native square
    size: images of their own sizes (`ImageList`), or a family's own preprocessed form (e.g.
    Qwen2.5-VL's flattened patches with their grids). Core code (CP, the batch checks, the
    metrics) reads only these; the family's encode_images reads the rest. In batch order
    (rows in order, each in reading order)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, index: slice) -> Images:
        """The images `index` selects (a contiguous range), in order."""

    @abstractmethod
    def to(self, device: torch.device | str, non_blocking: bool = False) -> ImageSet: ...

    @abstractmethod
    def pin_memory(self) -> ImageSet:
        """The same images in pinned host memory (data/loader.py)."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def sizes(self) -> list[tuple[int, int]]:
        """(height, width) in pixels of each image as it enters the encoder (a batch's
        fingerprint: step.check_same_batch)."""

    @abstractmethod
    def slots(self) -> list[int]:
        """Each image's embeddings: the slots it takes in a row (encode_images' rows)."""

    @abstractmethod
    def patches(self) -> list[int]:
        """Each image's encoder patches: what cp_vision = "shard" balances."""

    @abstractmethod
    def work(self) -> list[float]:
        """Each image's encoder work in the family's unit, the one its LayoutCost.image prices
        (LLaVA: one native-size image; Qwen2.5-VL: one patch)."""

    def units(self) -> ImageSet:
        """The pieces the encoder encodes independently, in batch order: encoding any split of
        them into contiguous ranges, each range on its own, and concatenating the rows gives
        exactly the rows of encoding the whole set. What cp_vision = "shard" deals to CP ranks,
        so a family whose encoder attends within parts of an image (Qwen2.5-VL: a video's
        frame groups) can spread one long video over ranks. By default the images
        themselves."""
        return self


class ImageRule(ABC):
    """How a family's images of their own sizes take slots in a row and travel in a batch
    (data/batch.py SlotRule, when not one number for every image)."""

    image_size: int  # the side of the model's native square images (an empty batch's size)

    @abstractmethod
    def slots(self, image: torch.Tensor) -> int:
        """The slots of one decoded image part: [C, H, W] (or a video's frames [T, C, H, W],
        for a family that reads videos)."""

    @abstractmethod
    def fit(self, height: int, width: int, frames: int = 0) -> tuple[int, int]:
        """(H, W) an image of height x width pixels (from its file's header) enters the encoder
        at (`frames` > 0: each frame of a video of that many kept frames read whole, for a
        family whose videos have their own bounds, which may depend on the frame count).
        ValueError for a size the family cannot take."""

    @abstractmethod
    def size_slots(self, height: int, width: int, frames: int = 1) -> int:
        """The slots of an image (frames > 1: a video) that enters the encoder at height x width
        pixels, known before decoding (from a file's header)."""

    @abstractmethod
    def batch(self, images: list[torch.Tensor]) -> Images:
        """A batch's decoded image parts, in batch order, as the family's encode_images takes
        them."""


# A batch's images in batch order: one [n, C, S, S] tensor when every image has the model's
# native size S (always with data.native_resolution_pixels = 0; n may be 0), else an ImageSet.
Images = torch.Tensor | ImageSet


def num_images(images: Images) -> int:
    return images.shape[0] if isinstance(images, torch.Tensor) else len(images)


def image_sizes(images: Images) -> list[tuple[int, int]]:
    """(height, width) of each image of a batch, in batch order."""
    if isinstance(images, torch.Tensor):
        return [(images.shape[2], images.shape[3])] * images.shape[0]
    return images.sizes()


def image_slot_counts(images: Images, tokens_per_image: int) -> list[int]:
    """The slots (embeddings) of each image of a batch: `tokens_per_image` each for a tensor
    batch (the model's native size), else the ImageSet's own."""
    if isinstance(images, torch.Tensor):
        return [tokens_per_image] * images.shape[0]
    return images.slots()


def image_patches(images: Images) -> list[int]:
    """Each image's encoder patches (what cp_vision = "shard" balances); a native-size tensor
    batch counts 1 each (its images all have the same patches, so only the count matters)."""
    if isinstance(images, torch.Tensor):
        return [1] * images.shape[0]
    return images.patches()


def vision_units(images: Images) -> Images:
    """The pieces of a batch's images the encoder encodes independently (ImageSet.units); a
    tensor batch's are its images."""
    return images if isinstance(images, torch.Tensor) else images.units()


def vit_work(images: Images) -> list[float]:
    """Each image's ViT work in native-image units: its patches / the patches of an image at the
    model's native size (1.0 for every image of a tensor batch, whose images have that size)."""
    if isinstance(images, torch.Tensor):
        return [1.0] * images.shape[0]
    return images.work()
