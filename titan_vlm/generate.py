"""Ask a model about an image, greedily, in one process:

    python -m titan_vlm.generate --checkpoint outputs/vlm_cp/checkpoint --image shapes.png \\
        [--prompt "..."]
    python -m titan_vlm.generate --hf-path <Hugging Face folder> --image cat.png \\
        --prompt "What is this?" [--raw-prompt] [--max-new-tokens N] [--print-ids]

A model that came from a Hugging Face folder (--hf-path, or a checkpoint trained from
model.hf_path) is asked as transformers asks it: the folder's image preprocessing, tokenizer and
chat template (data/hf_processor.py), decoding until one of the folder's end-of-sequence ids
(generation_config.json, else config.json). `--raw-prompt`: the prompt is tokenized as given
(the tokenizer's own special tokens, e.g. BOS) and each `<image>` in it becomes the image's
tokens, as the LLaVA processor does; without it the chat template wraps the prompt. The answer
then equals transformers' greedy `generate` on the same folder, image and prompt.

A built-in model (the byte tokenizer) is asked in one of two formats, as its training data had
them (`--template`, default auto):
  caption  the answer continues the prompt after the image, `[image] BOS prompt ...` (the built-in
           data's and a caption record's layout); auto picks it without --prompt or for a model
           trained on the built-in data
  chat     `BOS USER: [image]\\n<prompt> ASSISTANT:` and the answer (data/chat.py's chat template,
           LLaVA's layout); auto picks it for a --prompt to a model trained on a .json / .jsonl file
until EOS or --max-new-tokens. A built-in model trained with data.native_resolution_pixels > 0 is
asked about the image at its own aspect ratio, sized as its training images were
(data/images.py NativeResolution; a Hugging Face folder refuses that key, its processor fixes the
size).

`--print-ids` prints the generated token ids (the end-of-sequence id included, as transformers'
output has it), space-separated, as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from titan_vlm.config import JobConfig
from titan_vlm.data.batch import Part, Sample, SlotData, SlotRule, collate
from titan_vlm.data.chat import chat_question
from titan_vlm.data.hf_processor import (
    ChatError,
    chat_prompt,
    kept_frame_files,
    video_file_frames,
)
from titan_vlm.data.image_batch import ImageRule
from titan_vlm.data.images import load_image, load_native_image
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer
from titan_vlm.errors import ConfigError, UserError
from titan_vlm.models.spec import VisionLanguageModel
from titan_vlm.parallel.context_parallel import CPContext

TEMPLATES = ("auto", "caption", "chat")


@torch.no_grad()
def greedy(
    model: VisionLanguageModel,
    prefix: list[Part],
    eos: set[int],
    max_new_tokens: int,
    pad_id: int,
    image_id: int | None = None,
    rule: ImageRule | None = None,
    slot_data: SlotData | None = None,
) -> list[int]:
    """The greedy continuation of `prefix` (text ids, images and videos: data/batch.py parts):
    its token ids up to and including the first id in `eos`, or `max_new_tokens` of them.
    `rule` / `slot_data`: the family's (ModelSpec.data_rule): how its images take slots (None:
    each at the model's size) and its per-slot data (M-RoPE positions). The images are encoded
    once; each step decodes the whole row, one process (CPContext with no groups)."""
    slots: SlotRule = model.tokens_per_image if rule is None else rule
    ctx = CPContext()
    embeds: torch.Tensor | None = None
    out: list[int] = []
    while len(out) < max_new_tokens:
        row = Sample(prefix + [list(out)] if out else prefix)
        size = row.num_slots(slots)
        batch = collate([[row]], size, slots, model.image_size, pad_id, image_id, slot_data)
        if embeds is None:
            embeds = model.encode_images(batch.images)  # computed once
        tokens, _, layout = ctx.place(batch, model.bidirectional_images)
        logits = model.decode(tokens, embeds, layout)
        out.append(int(logits[0, -1].argmax()))
        if out[-1] in eos:
            break
    return out


def ask_builtin(
    model: VisionLanguageModel,
    image: torch.Tensor,
    prompt: str,
    max_new_tokens: int,
    tok: ByteTokenizer | HFTokenizer,
    chat: bool,
    rule: ImageRule | None = None,
    slot_data: SlotData | None = None,
) -> tuple[str, list[int]]:
    """A built-in model's answer and its ids: the greedy continuation of `prompt` after `image`
    ([3, H, W] in [-1, 1]); `chat`: the answer to `prompt` asked about `image` in the chat
    template (see the module docstring). `rule` / `slot_data`: as `greedy`'s (the family's
    ModelSpec.data_rule: LLaVA's native-resolution sizing, a Qwen-VL model's rule and
    positions)."""
    prefix: list[Part] = (
        chat_question(image, prompt, tok) if chat else [image, tok.encode(prompt, eos=False)]
    )
    ids = greedy(model, prefix, {tok.EOS}, max_new_tokens, tok.PAD, None, rule, slot_data)
    return tok.decode([i for i in ids if i != tok.EOS]), ids


def ask_built_in_model(
    model: VisionLanguageModel,
    cfg: JobConfig,
    image_path: str,
    prompt: str,
    max_new_tokens: int,
    chat: bool,
) -> tuple[str, list[int]]:
    """`ask_builtin` for a model trained from a built-in flavor with `cfg`: the image file read
    as its training images were (the model's size, or data.native_resolution_pixels' own), and
    its family's image rule and per-slot data (ModelSpec.data_rule: a Qwen-VL model sizes its
    images its own way and positions them with M-RoPE)."""
    from titan_vlm.data import native_resolution
    from titan_vlm.data.tokenizer import build_tokenizer
    from titan_vlm.models.registry import model_spec

    spec = model_spec(cfg)
    args = spec.args(cfg)
    native = native_resolution(cfg, args)
    image = (
        load_image(image_path, model.image_size)
        if native is None
        else load_native_image(image_path, native)
    )
    rule, slot_data = spec.data_rule(args, cfg)
    tok = build_tokenizer(cfg.model.tokenizer_path)
    return ask_builtin(model, image, prompt, max_new_tokens, tok, chat, rule, slot_data)


def generate(
    model: VisionLanguageModel,
    image: torch.Tensor,
    prompt: str = "",
    max_new_tokens: int = 64,
    tok: ByteTokenizer | HFTokenizer | None = None,
    chat: bool = False,
) -> str:
    """`ask_builtin`'s answer (the byte tokenizer by default)."""
    return ask_builtin(model, image, prompt, max_new_tokens, tok or ByteTokenizer(), chat)[0]


def eos_ids(folder: Path) -> set[int]:
    """The end-of-sequence ids transformers' generate stops at: generation_config.json's
    eos_token_id (an id or a list), else config.json's (top level or text_config)."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not JSON ({e})") from None
        value = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))
        if value is not None:
            return set(value) if isinstance(value, list) else {int(value)}
    raise ConfigError(f"{folder}: no eos_token_id in generation_config.json or config.json")


def is_video_file(video: list[str]) -> bool:
    """--video's paths are one video file (one path that is not an image file by its suffix),
    else a video's frame files."""
    from PIL import Image

    return len(video) == 1 and Path(video[0]).suffix.lower() not in Image.registered_extensions()


def ask_hf(
    model: VisionLanguageModel,
    cfg: JobConfig,
    image_paths: list[str],
    prompt: str,
    raw: bool,
    max_new_tokens: int,
    video: list[str] | None = None,
) -> tuple[str, list[int]]:
    """The answer of a model from a Hugging Face folder (cfg.model.hf_path), and its token ids
    (module docstring): its family's processor (ModelSpec.inputs) reads the images and the video
    (a video file, its frames sampled by the processor's settings, or its frame files) and the
    prompt, its data rule sizes them."""
    from titan_vlm.models.registry import model_spec

    spec = model_spec(cfg)
    folder = Path(cfg.model.hf_path)
    proc = spec.inputs(cfg)[1]
    if proc is None:
        raise ConfigError(
            f"model.hf_path: {folder} has no processor files (tokenizer.json and the image "
            "processor's settings): generate cannot read its prompts"
        )
    rule, slot_data = spec.data_rule(spec.args(cfg), cfg)
    parts: list[Part] = [proc.preprocess_image(path) for path in image_paths]
    if video and is_video_file(video):
        path = Path(video[0])
        try:  # the frames the folder's processor keeps, at the rate they were sampled
            ref, _ = video_file_frames(proc, path, None)
            parts.append(proc.preprocess_video_ref(ref))
        except ValueError as e:  # VideoError among them
            raise ConfigError(f"--video: {e}") from None
    elif video:  # the frames the folder's sampling keeps of them
        try:
            ref = kept_frame_files(proc, [Path(f) for f in video])
        except ValueError as e:
            raise ConfigError(f"--video: {e}") from None
        parts.append(proc.preprocess_video_ref(ref))
    if raw:
        prefix = proc.prompt_parts(prompt, parts)
    else:
        prefix = chat_prompt(proc, prompt, parts)
    eos = eos_ids(folder)
    ids = greedy(
        model, prefix, eos, max_new_tokens, proc.tokenizer.PAD, proc.image_token_id, rule, slot_data
    )
    return proc.tokenizer.decode([i for i in ids if i not in eos]), ids


def main(argv: list[str] | None = None) -> None:
    from titan_vlm.checkpoint import load_model_for_inference
    from titan_vlm.models.hf_export import hf_config, load_hf_model

    parser = argparse.ArgumentParser(description="Ask a model about an image (greedy decoding).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint", help="a titan_vlm checkpoint folder (with 'latest') or a step-N folder"
    )
    source.add_argument("--hf-path", help="a Hugging Face model folder (no titan checkpoint)")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image file; give it again for more images (a Hugging Face folder's model)",
    )
    parser.add_argument(
        "--video",
        nargs="+",
        help="a video file (mp4, webm, ...: pip install 'titan_vlm[video]'), or a video's frame "
        "files in order (a Hugging Face folder whose processor reads videos)",
    )
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--raw-prompt",
        action="store_true",
        help="Hugging Face models: tokenize the prompt as given, each <image> the image's tokens",
    )
    parser.add_argument(
        "--print-ids", action="store_true", help="print the generated ids as the last line"
    )
    parser.add_argument(
        "--template",
        choices=TEMPLATES,
        default="auto",
        help="built-in models: caption, chat, or auto (chat for a --prompt to a model trained on "
        "a .json / .jsonl file)",
    )
    opts = parser.parse_args(argv)
    try:
        if opts.hf_path:
            cfg = hf_config(opts.hf_path)
            model, _ = load_hf_model(cfg)
        else:
            model, cfg = load_model_for_inference(opts.checkpoint)
        if cfg.model.hf_path:
            answer, ids = ask_hf(
                model,
                cfg,
                opts.image,
                opts.prompt,
                opts.raw_prompt,
                opts.max_new_tokens,
                opts.video,
            )
            print(answer.strip())
        else:
            if opts.raw_prompt:
                raise ConfigError("--raw-prompt is for models from a Hugging Face folder")
            if len(opts.image) != 1 or opts.video:
                raise ConfigError(
                    "a built-in model is asked about one --image (no --video): give exactly one"
                )
            chat = opts.template == "chat" or (
                opts.template == "auto" and bool(opts.prompt) and cfg.data.dataset != "synthetic"
            )
            answer, ids = ask_built_in_model(
                model, cfg, opts.image[0], opts.prompt, opts.max_new_tokens, chat
            )
            print(answer.strip() if chat else opts.prompt + answer)
    except (UserError, ChatError, FileNotFoundError) as e:  # CheckpointError too: one line
        sys.exit(f"error: {e}")
    if opts.print_ids:
        print(" ".join(str(i) for i in ids))


if __name__ == "__main__":
    main()
