"""Hugging Face model folders as transformers itself writes them (config classes,
save_pretrained; no downloads), for the tests of every family. Each writer returns the
transformers model it saved, perturbed off its initial values so that a bias or norm that is not
loaded shows.

    save_qwen(folder, tie=False)   a tiny Qwen2_5_VLForConditionalGeneration: window_size 56 with
                                   14-pixel patches and 2x2 merging (windows of 2x2 merge units),
                                   blocks 1 and 3 attending whole frames, mrope_section (2, 3, 3)
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

VOCAB = 300
IMAGE, VIDEO, START, END = 290, 291, 292, 293

VISION = dict(
    depth=4,
    hidden_size=32,
    num_heads=2,
    intermediate_size=48,
    out_hidden_size=64,
    fullatt_block_indexes=[1, 3],
    window_size=56,
    tokens_per_second=2,
)
TEXT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    bos_token_id=None,
    eos_token_id=None,
)


def save_qwen(
    folder: Path,
    tie: bool = False,
    vocab: int = VOCAB,
    image: int = IMAGE,
    video: int = VIDEO,
    start: int = START,
    end: int = END,
) -> Qwen2_5_VLForConditionalGeneration:
    """The tiny model, saved to `folder`; `vocab` and the placeholder ids (<|image_pad|>,
    <|video_pad|>, <|vision_start|>, <|vision_end|>) where a folder's real tokenizer gives
    others."""
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        vision_config=VISION,
        text_config={**TEXT, "vocab_size": vocab},
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=tie,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # off the initial values: a bias or norm not loaded would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model
