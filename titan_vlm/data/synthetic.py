"""The built-in dataset: procedurally drawn images with captions that only the image can predict.

Each image holds 1-4 copies of one shape in one colour, placed in distinct cells of a 2x2 grid.
The caption names the count, colour and shape ("three red circles."); with
`data.sentences_per_image > 1` more sentences follow (where each object is, ...), so the text is
long and context parallelism has real work. With `data.images_per_sample = k` a row holds k
images (0 is a text-only row) and the text describes each in turn ("image 2: one blue cross.").

Sample `i` is a pure function of (seed, i); the rows of a global batch are numbered
`step * global_batch + dp_rank * local_batch + j`, so the data is deterministic per seed and per
data-parallel rank and does not depend on the CP degree (CP ranks of one group share rows).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

IGNORE_INDEX = -100
COLORS = {
    "red": (1.0, 0.1, 0.1), "green": (0.1, 0.9, 0.1), "blue": (0.2, 0.3, 1.0),
    "yellow": (1.0, 0.9, 0.1), "magenta": (0.9, 0.1, 0.9), "white": (1.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle", "cross")
COUNTS = ("one", "two", "three", "four")
CELLS = ("top left", "top right", "bottom left", "bottom right")


@dataclass
class Batch:
    images: torch.Tensor  # [B, k, 3, H, W]: k images per row (k may be 0), values in [-1, 1]
    tokens: torch.Tensor  # [B, T] text input ids (starts with BOS)
    labels: torch.Tensor  # [B, T] next-token targets, IGNORE_INDEX where there is no loss

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.images.to(device), self.tokens.to(device), self.labels.to(device))


def _shape_mask(shape: str, dx: torch.Tensor, dy: torch.Tensor, r: float) -> torch.Tensor:
    if shape == "square":
        return (dx.abs() <= r) & (dy.abs() <= r)
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "triangle":  # apex up
        return (dy >= -r) & (dy <= r) & (dx.abs() <= (dy + r) / 2)
    if shape == "cross":
        bar = r / 3
        return ((dx.abs() <= bar) & (dy.abs() <= r)) | ((dy.abs() <= bar) & (dx.abs() <= r))
    raise ValueError(shape)


def draw_image(size: int, shape: str, color: tuple[float, float, float], cells: list[int],
               rng: random.Random) -> torch.Tensor:
    """A [3, size, size] image in [0, 1] with `shape` drawn once in each of `cells`."""
    img = torch.zeros(3, size, size)
    ys, xs = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    half = size / 2
    for cell in cells:
        cx = (cell % 2) * half + half / 2 + rng.uniform(-size / 16, size / 16)
        cy = (cell // 2) * half + half / 2 + rng.uniform(-size / 16, size / 16)
        r = half * rng.uniform(0.28, 0.4)
        mask = _shape_mask(shape, xs - cx, ys - cy, r)
        for c in range(3):
            img[c][mask] = color[c]
    return img


def describe(count: int, color: str, shape: str, cells: list[int], sentences: int) -> str:
    plural = ("es" if shape.endswith("s") else "s") if count > 1 else ""
    out = [f"{COUNTS[count - 1]} {color} {shape}{plural}."]
    extra = [f"{CELLS[c]}: {color} {shape}." for c in cells]
    extra += [f"the {shape}{plural} {'are' if count > 1 else 'is'} {color}.",
              f"there {'are' if count > 1 else 'is'} {COUNTS[count - 1]}."]
    empty = [c for c in range(4) if c not in cells]
    extra += [f"{CELLS[c]}: nothing." for c in empty]
    for i in range(sentences - 1):
        out.append(extra[i % len(extra)])
    return " ".join(out)


class SyntheticCaptions:
    """Rows `[image tokens of k images, BOS caption EOS pad...]` of a fixed length, loss on the
    text only. `tokens_per_image` is the model's image-token count for one image."""

    def __init__(self, image_size: int, tokens_per_image: int, seq_len: int, seed: int,
                 sentences_per_image: int = 1, blank_images: bool = False, images_per_sample: int = 1,
                 tokenizer: ByteTokenizer | HFTokenizer | None = None):
        self.image_size = image_size
        self.images_per_sample = images_per_sample
        self.text_len = seq_len - images_per_sample * tokens_per_image
        if self.text_len < 2:
            raise ValueError(f"seq_len {seq_len} leaves no room for text after {images_per_sample} images of "
                             f"{tokens_per_image} tokens")
        self.seed = seed
        self.sentences = sentences_per_image
        self.blank = blank_images
        self.tokenizer = tokenizer or ByteTokenizer()

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        rng = random.Random(f"{self.seed}/{index}")
        images, captions = [], []
        for _ in range(self.images_per_sample):
            count = rng.randint(1, 4)
            color = rng.choice(sorted(COLORS))
            shape = rng.choice(SHAPES)
            cells = sorted(rng.sample(range(4), count))
            images.append(draw_image(self.image_size, shape, COLORS[color], cells, rng))
            captions.append(describe(count, color, shape, cells, self.sentences))
        image = torch.stack(images) if images else torch.zeros(0, 3, self.image_size, self.image_size)
        if self.blank:
            image.zero_()
        if len(captions) == 1:
            text = captions[0]
        elif captions:
            text = " ".join(f"image {i + 1}: {c}" for i, c in enumerate(captions))
        else:
            text = "no image."
        ids = self.tokenizer.encode(text)[: self.text_len + 1]
        tokens = torch.full((self.text_len,), self.tokenizer.PAD, dtype=torch.long)
        labels = torch.full((self.text_len,), IGNORE_INDEX, dtype=torch.long)
        tokens[: len(ids) - 1] = torch.tensor(ids[:-1])
        labels[: len(ids) - 1] = torch.tensor(ids[1:])
        return image * 2 - 1, tokens, labels, text

    def batch(self, step: int, dp_rank: int, dp_size: int, batch_size: int) -> Batch:
        first = (step * dp_size + dp_rank) * batch_size
        rows = [self.sample(first + j) for j in range(batch_size)]
        return Batch(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
                     torch.stack([r[2] for r in rows]))


def main() -> None:
    """`python -m titan_vlm.data.synthetic OUT.png [--seed S] [--size N]`: draw one image of the
    built-in kind (e.g. to ask a trained model about) and print its caption."""
    import argparse

    from PIL import Image

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--size", type=int, default=32, help="pixels (the model resizes anyway)")
    opts = parser.parse_args()
    image, _, _, caption = SyntheticCaptions(opts.size, 1, 64, opts.seed).sample(0)
    pixels = ((image[0] + 1) / 2 * 255).round().byte().permute(1, 2, 0).contiguous()
    Image.fromarray(pixels.numpy()).save(opts.out)
    print(caption)


if __name__ == "__main__":
    main()
