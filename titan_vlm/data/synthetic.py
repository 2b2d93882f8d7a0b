"""The built-in dataset: procedurally drawn images with captions that only the image can predict.

Each image holds 1-4 copies of one shape in one colour, placed in distinct cells of a 2x2 grid.
The caption names the count, colour and shape ("three red circles."); with
`data.sentences_per_image > 1` more sentences follow (where each object is, ...), so the text is
long and context parallelism has real work. With `data.images_per_sample = k` a row holds k
images (0 is a text-only row) and the text describes each in turn ("image 2: one blue cross.").
With `data.packing = true` rows hold several samples of mixed kinds and lengths: text only,
captions, an image in the middle or at the end of the text, and up to k interleaved images.

Row `i` is a pure function of (seed, i); the rows of a global batch are numbered
`step * global_batch + dp_rank * local_batch + j` (data/dataset.py), so the data is
deterministic per seed and per data-parallel rank and does not depend on the CP degree (CP ranks
of one group share rows).
"""

from __future__ import annotations

import itertools
import random

import torch

from titan_vlm.data.batch import Part, Sample, SlotData, SlotRule, pack
from titan_vlm.data.dataset import Dataset
from titan_vlm.data.image_batch import ImageRule
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

COLORS = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.1),
    "blue": (0.2, 0.3, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "magenta": (0.9, 0.1, 0.9),
    "white": (1.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle", "cross")
COUNTS = ("one", "two", "three", "four")
CELLS = ("top left", "top right", "bottom left", "bottom right")


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


def draw_image(
    size: int, shape: str, color: tuple[float, float, float], cells: list[int], rng: random.Random
) -> torch.Tensor:
    """A [3, size, size] image in [0, 1] with `shape` drawn once in each of `cells`."""
    img = torch.zeros(3, size, size)
    ys, xs = torch.meshgrid(
        torch.arange(size, dtype=torch.float32),
        torch.arange(size, dtype=torch.float32),
        indexing="ij",
    )
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
    extra += [
        f"the {shape}{plural} {'are' if count > 1 else 'is'} {color}.",
        f"there {'are' if count > 1 else 'is'} {COUNTS[count - 1]}.",
    ]
    empty = [c for c in range(4) if c not in cells]
    extra += [f"{CELLS[c]}: nothing." for c in empty]
    for i in range(sentences - 1):
        out.append(extra[i % len(extra)])
    return " ".join(out)


TEXT_ONLY = (
    "no image.",
    "count: one two three four.",
    "colors: red green blue yellow magenta white.",
    "shapes: square circle triangle cross.",
)


class SyntheticCaptions(Dataset):
    """The built-in dataset. `packing=False`: each row is one sample, `[k images, BOS caption
    EOS]` (k = images_per_sample, the images first). `packing=True`: rows packed with samples of
    several kinds and lengths (`packed_sample`), each with 0..images_per_sample images placed at
    the start, in the middle or at the end of its text. `tokens_per_image` is the model's
    image-token count for one image."""

    # The data counters of the trainer's metrics (data/dataset.py): drawn data has no bad samples
    # (Dataset's 0s), and a long caption is cut to its row by design (data.sentences_per_image).
    dropped: frozenset[int] = frozenset()

    def __init__(
        self,
        image_size: int,
        tokens_per_image: int,
        seq_len: int,
        seed: int,
        sentences_per_image: int = 1,
        blank_images: bool = False,
        images_per_sample: int = 1,
        tokenizer: ByteTokenizer | HFTokenizer | None = None,
        packing: bool = False,
        rule: ImageRule | None = None,
        slot_data: SlotData | None = None,
    ):
        self.image_size = image_size
        self.tokens_per_image = tokens_per_image
        # every image is drawn at image_size and takes tokens_per_image slots; a family whose
        # images travel in their own form (`rule`: its ImageRule) batches them its way
        self.slots: SlotRule = rule if rule is not None else tokens_per_image
        self.slot_data = slot_data
        self.seq_len = seq_len
        self.images_per_sample = images_per_sample
        if seq_len - images_per_sample * tokens_per_image < 2:
            raise ValueError(
                f"seq_len {seq_len} leaves no room for text after {images_per_sample} images of "
                f"{tokens_per_image} tokens"
            )
        self.seed = seed
        self.sentences = sentences_per_image
        self.blank = blank_images
        self.packing = packing
        self.tokenizer = tokenizer or ByteTokenizer()

    def random_image(self, rng: random.Random, sentences: int) -> tuple[torch.Tensor, str]:
        """One image in [-1, 1] and its caption."""
        count = rng.randint(1, 4)
        color = rng.choice(sorted(COLORS))
        shape = rng.choice(SHAPES)
        cells = sorted(rng.sample(range(4), count))
        image = draw_image(self.image_size, shape, COLORS[color], cells, rng)
        if self.blank:
            image.zero_()
        return image * 2 - 1, describe(count, color, shape, cells, sentences)

    def sample(self, index: int) -> tuple[torch.Tensor, str]:
        """Unpacked sample `index`: its images [k, 3, H, W] and caption text (the row is
        `[k images, BOS text EOS]`)."""
        rng = random.Random(f"{self.seed}/{index}")
        drawn = [self.random_image(rng, self.sentences) for _ in range(self.images_per_sample)]
        images = (
            torch.stack([d[0] for d in drawn])
            if drawn
            else torch.zeros(0, 3, self.image_size, self.image_size)
        )
        captions = [d[1] for d in drawn]
        if len(captions) == 1:
            text = captions[0]
        elif captions:
            text = " ".join(f"image {i + 1}: {c}" for i, c in enumerate(captions))
        else:
            text = "no image."
        return images, text

    def packed_sample(self, row: int, j: int) -> Sample:
        """Sample j of packed row `row`: one of
            text only            BOS text EOS
            caption              [image] BOS caption EOS
            image in the middle  BOS look: [image] caption EOS
            image at the end     BOS here is a picture: [image]
            interleaved          BOS image 1: [image] caption image 2: [image] caption ... EOS
        with 1..sentences_per_image sentences per caption."""
        rng = random.Random(f"{self.seed}/packed/{row}/{j}")
        enc = self.tokenizer.encode
        k = self.images_per_sample
        kind = rng.choices(
            ["text", "caption", "middle", "end", "interleaved"], weights=[15, 40, 15, 10, 20]
        )[0]
        if k == 0:
            kind = "text"
        elif kind == "interleaved" and k == 1:
            kind = "caption"
        sentences = rng.randint(1, self.sentences)
        if kind == "text":
            return Sample([enc(rng.choice(TEXT_ONLY))])
        if kind == "interleaved":
            count = rng.randint(2, k)
            parts: list[Part] = [enc("image 1:", eos=False)]
            for i in range(count):
                image, caption = self.random_image(rng, sentences)
                after = (
                    enc(f" image {i + 2}:", bos=False, eos=False)
                    if i + 1 < count
                    else [self.tokenizer.EOS]
                )
                parts += [image, enc(f" {caption}", bos=False, eos=False) + after]
            return Sample(parts)
        image, caption = self.random_image(rng, sentences)
        if kind == "caption":
            return Sample([image, enc(caption)])
        if kind == "middle":
            return Sample([enc("look:", eos=False), image, enc(f" {caption}", bos=False)])
        return Sample([enc("here is a picture:", eos=False), image])

    def row(self, index: int) -> list[Sample]:
        """The samples of row `index` (a pure function of the seed and the index)."""
        if self.packing:
            stream = (self.packed_sample(index, j) for j in itertools.count())
            return pack(stream, self.seq_len, self.tokens_per_image)
        images, text = self.sample(index)
        ids = self.tokenizer.encode(text)
        return [Sample([*images, ids]).truncated(self.seq_len, self.tokens_per_image)]

    def read(self, rows: range) -> list[list[Sample]]:
        return [self.row(r) for r in rows]

    def describe(self) -> str:
        k = self.images_per_sample
        return (
            f"packed rows (data.packing), up to {k} image(s) per sample"
            if self.packing
            else f"one sample per row, {k} image(s) per sample"
        )


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
    images, caption = SyntheticCaptions(opts.size, 1, 64, opts.seed).sample(0)
    pixels = ((images[0] + 1) / 2 * 255).round().byte().permute(1, 2, 0).contiguous()
    Image.fromarray(pixels.numpy()).save(opts.out)
    print(caption)


if __name__ == "__main__":
    main()
