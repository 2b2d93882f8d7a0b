"""Image files into the model's input: the one place training data and generate decode images."""

from __future__ import annotations

from pathlib import Path

import torch


class ImageTooLarge(ValueError):
    """An image file whose header says it has more pixels than allowed (nothing was decoded)."""


def load_image(path: str | Path, size: int, max_pixels: int | None = None) -> torch.Tensor:
    """An image file as a [3, size, size] tensor in [-1, 1] (SigLIP's normalisation, mean 0.5 and
    std 0.5 per channel): converted to RGB, resized to size x size with bicubic resampling (the
    aspect ratio is not kept, as SigLIP's own preprocessing does).

    `max_pixels`: raise ImageTooLarge, from the header alone, for an image with more pixels.
    Pillow's own errors (a missing, truncated or corrupt file) pass through."""
    from PIL import Image

    try:
        img = Image.open(path)
    except Image.DecompressionBombError as e:  # Pillow's own bound (2 x Image.MAX_IMAGE_PIXELS)
        raise ImageTooLarge(str(e)) from None
    with img:
        width, height = img.size  # from the header; pixels are decoded lazily below
        if max_pixels is not None and width * height > max_pixels:
            raise ImageTooLarge(
                f"image of {width}x{height} pixels is larger than "
                f"data.max_image_pixels={max_pixels}"
            )
        rgb = img.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.BICUBIC)
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return pixels.permute(2, 0, 1).float() / 255 * 2 - 1
