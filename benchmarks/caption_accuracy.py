"""How well a trained checkpoint describes new images of the built-in kind:

    python benchmarks/caption_accuracy.py --checkpoint outputs/vlm_cp/checkpoint [--images 50]

Draws images the training never saw (a seed of their own), asks the model for a caption with
titan_vlm.generate (greedy, no prompt, as `python -m titan_vlm.generate` does), and counts how
often the first sentence names the count, the colour and the shape right, and all three.
"""

from __future__ import annotations

import argparse

from titan_vlm.checkpoint import load_model_for_inference
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.data.tokenizer import build_tokenizer
from titan_vlm.generate import generate

SEED = 987654  # not a training seed: these images are new to the model


def first_sentence_words(text: str) -> list[str]:
    """'three red circles. top left: ...' -> ['three', 'red', 'circle'] (plural folded)."""
    words = text.split(".")[0].split() + ["", "", ""]
    return [
        w[:-2] if w.endswith("sses") else w[:-1] if w.endswith("s") and not w.endswith("ss") else w
        for w in words[:3]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--images", type=int, default=50)
    opts = parser.parse_args()
    model, cfg = load_model_for_inference(opts.checkpoint)
    tok = build_tokenizer(cfg.model.tokenizer_path)
    data = SyntheticCaptions(
        model.args.vision.image_size,
        model.args.tokens_per_image,
        64,
        SEED,
        images_per_sample=1,
        tokenizer=tok,
    )
    right = {"count": 0, "colour": 0, "shape": 0, "all three": 0}
    for i in range(opts.images):
        images, truth = data.sample(i)
        said = first_sentence_words(generate(model, images[0], max_new_tokens=40, tok=tok))
        want = first_sentence_words(truth)
        hits = [s == w for s, w in zip(said, want)]
        for key, hit in zip(right, [*hits, all(hits)]):
            right[key] += hit
    print(
        f"{opts.checkpoint}: {opts.images} new images, right: "
        + ", ".join(f"{k} {v}/{opts.images}" for k, v in right.items())
    )


if __name__ == "__main__":
    main()
