"""Ask a trained model about an image:

    python -m titan_vlm.generate --checkpoint outputs/vlm_cp/checkpoint --image shapes.png \\
        [--prompt "..."]

Greedy decoding, one process, no parallelism. The image is resized to the model's input size
(data/images.py, as in training). Two prompt formats, as the training data has them
(`--template`, default auto):
  caption  the answer continues the prompt after the image, `[image] BOS prompt ...` (the built-in
           data's and a caption record's layout); auto picks it without --prompt or for a model
           trained on the built-in data
  chat     `BOS USER: [image]\n<prompt> ASSISTANT:` and the answer (data/jsonl.py's chat template,
           LLaVA's layout); auto picks it for a --prompt to a model trained on a .json / .jsonl file
until EOS or --max-new-tokens.
"""

from __future__ import annotations

import argparse

import torch

from titan_vlm.data.batch import Part, Sample, collate
from titan_vlm.data.images import load_image
from titan_vlm.data.jsonl import chat_question
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer
from titan_vlm.models.vlm import VLM
from titan_vlm.parallel.context_parallel import shard_batch

TEMPLATES = ("auto", "caption", "chat")


@torch.no_grad()
def generate(
    model: VLM,
    image: torch.Tensor,
    prompt: str = "",
    max_new_tokens: int = 64,
    tok: ByteTokenizer | HFTokenizer | None = None,
    chat: bool = False,
) -> str:
    """Greedy continuation of `prompt` after `image` ([3, H, W] in [-1, 1]); `chat`: the answer
    to `prompt` asked about `image` in the chat template (see the module docstring)."""
    tok = tok or ByteTokenizer()
    prefix: list[Part] = (
        chat_question(image, prompt, tok) if chat else [image, tok.encode(prompt, eos=False)]
    )
    embeds = model.encode_images(image.unsqueeze(0))  # [1, N, D], computed once
    tpi = model.args.tokens_per_image
    out: list[int] = []
    for _ in range(max_new_tokens):
        row = Sample(prefix + [out] if out else prefix)
        batch = collate([[row]], row.num_slots(tpi), tpi, image.shape[-1], tok.PAD)
        tokens, _, layout = shard_batch(
            batch, None, bidirectional_images=model.args.image_attention == "bidirectional"
        )
        logits = model.decoder(tokens, layout.place_images(embeds), layout)
        nxt = int(logits[0, -1].argmax())
        if nxt == tok.EOS:
            break
        out.append(nxt)
    return tok.decode(out)


def main() -> None:
    from titan_vlm.checkpoint import load_model_for_inference
    from titan_vlm.data.tokenizer import build_tokenizer

    parser = argparse.ArgumentParser(
        description="Describe an image with a trained titan_vlm checkpoint."
    )
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint folder (with 'latest') or a step-N folder"
    )
    parser.add_argument("--image", required=True)
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--template",
        choices=TEMPLATES,
        default="auto",
        help="prompt format: caption, chat, or auto (chat for a --prompt to a model trained on a "
        ".json / .jsonl file)",
    )
    opts = parser.parse_args()
    model, cfg = load_model_for_inference(opts.checkpoint)
    image = load_image(opts.image, model.args.vision.image_size)
    tok = build_tokenizer(cfg.model.tokenizer_path)
    chat = opts.template == "chat" or (
        opts.template == "auto" and bool(opts.prompt) and cfg.data.dataset != "synthetic"
    )
    answer = generate(model, image, opts.prompt, opts.max_new_tokens, tok, chat=chat)
    print(answer.strip() if chat else opts.prompt + answer)


if __name__ == "__main__":
    main()
