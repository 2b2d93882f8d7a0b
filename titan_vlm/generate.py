"""Ask a trained model about an image:

    python -m titan_vlm.generate --checkpoint outputs/vlm_cp/checkpoint --image shapes.png [--prompt "..."]

Greedy decoding, one process, no parallelism. The image is resized to the model's input size;
the answer continues the prompt after the image (a row `[image tokens, BOS prompt ...]`, as in
training) until EOS or --max-new-tokens.
"""

from __future__ import annotations

import argparse

import torch

from titan_vlm.data.batch import Sample, collate
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer
from titan_vlm.models.vlm import VLM
from titan_vlm.parallel.context_parallel import shard_batch


def load_image(path: str, size: int) -> torch.Tensor:
    """An image file as a [3, size, size] tensor in [-1, 1], the training data's range."""
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB").resize((size, size), Image.NEAREST)
        pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
    return pixels.permute(2, 0, 1).float() / 255 * 2 - 1


@torch.no_grad()
def generate(model: VLM, image: torch.Tensor, prompt: str = "", max_new_tokens: int = 64,
             tok: ByteTokenizer | HFTokenizer | None = None) -> str:
    """Greedy continuation of `prompt` after `image` ([3, H, W] in [-1, 1])."""
    tok = tok or ByteTokenizer()
    ids = tok.encode(prompt, eos=False)
    embeds = model.encode_images(image.unsqueeze(0))  # [1, N, D], computed once
    tpi = model.args.tokens_per_image
    out: list[int] = []
    for _ in range(max_new_tokens):
        row = Sample([image, ids + out])
        batch = collate([[row]], row.num_slots(tpi), tpi, image.shape[-1], tok.PAD)
        tokens, _, layout = shard_batch(batch, None, bidirectional_images=model.args.image_attention == "bidirectional")
        logits = model.decoder(tokens, layout.place_images(embeds), layout)
        nxt = int(logits[0, -1].argmax())
        if nxt == tok.EOS:
            break
        out.append(nxt)
    return tok.decode(out)


def main() -> None:
    from titan_vlm.checkpoint import load_model_for_inference
    from titan_vlm.data.tokenizer import build_tokenizer

    parser = argparse.ArgumentParser(description="Describe an image with a trained titan_vlm checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder (with 'latest') or a step-N folder")
    parser.add_argument("--image", required=True)
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    opts = parser.parse_args()
    model, cfg = load_model_for_inference(opts.checkpoint)
    image = load_image(opts.image, model.args.vision.image_size)
    tok = build_tokenizer(cfg.model.tokenizer_path)
    print(opts.prompt + generate(model, image, opts.prompt, opts.max_new_tokens, tok))


if __name__ == "__main__":
    main()
