"""Hugging Face model folders as transformers itself writes them (config classes,
save_pretrained, processor classes; no downloads), the one place the tests of every family get
them from. Each model writer returns the transformers model it saved, perturbed off its initial
values so that a bias or norm that is not loaded shows (`perturb`).

    save_qwen(folder, tie=False)   a tiny Qwen2_5_VLForConditionalGeneration: window_size 56 with
                                   14-pixel patches and 2x2 merging (windows of 2x2 merge units),
                                   blocks 1 and 3 attending whole frames, mrope_section (2, 3, 3)
    save_qwen3(folder, tie=False)  a tiny Qwen3VLForConditionalGeneration: 16-pixel patches, 2x2
                                   merging, a 4x4 learned position grid, DeepStack from tower
                                   blocks 0 and 1, interleaved mrope_section (2, 3, 3)
    save_qwen3_moe(folder, hub_layout=False)
                                   a tiny Qwen3VLMoeForConditionalGeneration (save_qwen3's
                                   tower, 4 experts, top 2, one dense layer); hub_layout: its
                                   experts transposed as the hub's folders hold them
    save_llava(folder, vision, text, image_token_index=LLAVA_IMAGE, **top)
                                   a tiny LlavaForConditionalGeneration of the given vision and
                                   text configs (CLIP or SigLIP tower; tied or not and the
                                   projector and feature keys in `top`): every LLaVA model the
                                   tests write
    save_model(folder, model)      any transformers model (a vision tower, a causal LM, a CLIP
                                   or SigLIP model), perturbed and saved
    save_towers(folder)            a SigLIP vision tower and a Llama causal LM, separate folders
    save_llava_processor(folder, kind, transformers4=False)
                                   a LlavaProcessor's files (a byte-level BPE tokenizer trained
                                   here, a chat template, a CLIP or SigLIP image processor:
                                   PROCESSORS) and a LlavaConfig matching them; transformers4:
                                   in the layout transformers 4.x writes
    save_llava_folder(folder, kind)
                                   save_llava_processor's files and a save_llava model matching
                                   them (LLAVA_FOLDERS: four tower x decoder pairs)
    save_sentencepiece_tokenizer(folder)
                                   a Llama 2-style tokenizer.json (byte-fallback BPE) alone
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MistralConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen3Config,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    SiglipVisionConfig,
)

# -- Qwen2.5-VL ----------------------------------------------------------------------------------

VOCAB = 300
IMAGE, VIDEO, START, END = 290, 291, 292, 293

QWEN_VISION = dict(
    depth=4,
    hidden_size=32,
    num_heads=2,
    intermediate_size=48,
    out_hidden_size=64,
    fullatt_block_indexes=[1, 3],
    window_size=56,
    tokens_per_second=2,
)
QWEN_TEXT = dict(
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
        vision_config=QWEN_VISION,
        text_config={**QWEN_TEXT, "vocab_size": vocab},
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=tie,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    perturb(model)
    model.save_pretrained(folder)
    return model


# -- Qwen3-VL ------------------------------------------------------------------------------------

QWEN3_VISION = dict(
    depth=3,
    hidden_size=32,
    num_heads=2,
    intermediate_size=48,
    out_hidden_size=64,
    num_position_embeddings=16,  # a 4 x 4 grid, interpolated to every image's
    deepstack_visual_indexes=[0, 1],
)
QWEN3_TEXT = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=VOCAB,
    rope_parameters={
        "rope_type": "default",
        "mrope_section": [2, 3, 3],
        "rope_theta": 10000.0,
        "mrope_interleaved": True,
    },
)


# Qwen3-VL-MoE's text model: 4 experts of width 24, top 2; layer 1 dense (mlp_only_layers), so
# both kinds of feed-forward are read; the router's loss in the training loss, coefficient 0.05
QWEN3_MOE_TEXT = dict(
    QWEN3_TEXT,
    moe_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
    output_router_logits=True,
    router_aux_loss_coef=0.05,
)


def save_qwen3_moe(folder: Path, hub_layout: bool = False) -> Qwen3VLMoeForConditionalGeneration:
    """A tiny Qwen3VLMoeForConditionalGeneration (save_qwen3's tower, QWEN3_MOE_TEXT), saved to
    `folder` as transformers 5 writes it (fused experts [E, 2 ffn, dim], [E, dim, ffn]); with
    `hub_layout`, its expert tensors rewritten transposed, as the hub's Qwen3-VL-MoE folders hold
    them (which transformers transposes back on load)."""
    model = _save_qwen3_kind(
        folder, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, QWEN3_MOE_TEXT
    )
    if hub_layout:
        from safetensors.torch import load_file, save_file

        path = folder / "model.safetensors"
        tensors = load_file(path)
        for name in tensors:
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    return model


def save_qwen3(
    folder: Path,
    tie: bool = False,
    vocab: int = VOCAB,
    ids: tuple[int, ...] = (IMAGE, VIDEO, START, END),
) -> Qwen3VLForConditionalGeneration:
    """A tiny Qwen3VLForConditionalGeneration (16-pixel patches, 2x2 merging, a 4x4 learned
    position grid, DeepStack features from tower blocks 0 and 1), saved to `folder`; `vocab`
    and the (image, video, vision start, vision end) `ids`: a tokenizer's, where it has one."""
    text = {**QWEN3_TEXT, "vocab_size": vocab}
    model_class = Qwen3VLForConditionalGeneration
    return _save_qwen3_kind(folder, Qwen3VLConfig, model_class, text, tie, ids)


def _save_qwen3_kind(
    folder: Path,
    config_class: Any,
    model_class: Any,
    text: dict,
    tie: bool = False,
    ids: tuple[int, ...] = (IMAGE, VIDEO, START, END),
) -> Any:
    """A tiny Qwen3-VL of `model_class` (dense or MoE): QWEN3_VISION, `text`, the placeholder
    ids, seeded 0, perturbed and saved to `folder`."""
    torch.manual_seed(0)
    image, video, start, end = ids
    config = config_class(
        vision_config=QWEN3_VISION,
        text_config=text,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=tie,
    )
    model = model_class(config).eval()
    perturb(model)
    model.save_pretrained(folder)
    return model


# -- LLaVA ---------------------------------------------------------------------------------------

LLAVA_VOCAB = 96
LLAVA_IMAGE = LLAVA_VOCAB - 1  # image_token_index
TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=16,
    patch_size=4,
)
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=LLAVA_VOCAB,
)
# a Qwen3-MoE text model for LLaVA: 4 experts of width 16, top 2, renormalised; layer 0 dense
QWEN3_MOE = dict(
    TEXT,
    model_type="qwen3_moe",
    head_dim=8,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that the tiny head_dim's wavelengths fall in all three bands of the formula
    "original_max_position_embeddings": 16,
}


def perturb(model: torch.nn.Module) -> None:
    """transformers initialises biases to 0 and norm weights to 1, which would hide a bias or a
    norm that is not loaded: move every parameter off its initial value."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def save_model(folder: Path, model: torch.nn.Module) -> torch.nn.Module:
    """`model` perturbed and saved to `folder` (as it is: seed before building it)."""
    perturb(model.eval())
    model.save_pretrained(folder)
    return model


def save_llava(
    folder: Path, vision, text, image_token_index: int = LLAVA_IMAGE, **top
) -> LlavaForConditionalGeneration:
    """The tiny LLaVA of `vision` and `text` configs (top-level LlavaConfig keys in `top`:
    tied or not, projector, feature layer and strategy), seeded 0: the same folder for the same
    arguments. Every LLaVA model the tests write is written here."""
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_index, **top
    )
    model = LlavaForConditionalGeneration(config).eval()
    perturb(model)
    model.save_pretrained(folder)
    return model


def save_towers(folder: Path) -> tuple[Path, Path]:
    """A SiglipVisionModel folder and a LlamaForCausalLM folder, for separate towers
    (model.hf_vision_path, model.hf_text_path): folder/siglip, folder/llama."""
    from transformers import LlamaForCausalLM, SiglipVisionModel

    torch.manual_seed(0)
    vision = SiglipVisionModel(SiglipVisionConfig(**TOWER))
    text = LlamaForCausalLM(LlamaConfig(**TEXT))
    for model, name in ((vision, "siglip"), (text, "llama")):
        save_model(folder / name, model)
    return folder / "siglip", folder / "llama"


LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "USER: What is this? ASSISTANT: A red circle. Are you sure? yes.",
    "system You are a helpful assistant. user assistant",
    "What colour is the square? It is blue, and the triangle is green.",
]
# llava-hf/llava-1.5-7b-hf's template: images first, no end token after an answer
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# Qwen2-VL's ChatML template, with LLaVA's image token
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<image>{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# LLaVA-1.5: CLIP tower (class token; "default" drops it), BOS added by the tokenizer.
# SigLIP + ChatML (Qwen2-style): no BOS token at all.
PROCESSORS = {
    "clip": dict(template=LLAVA_TEMPLATE, bos="<s>", size=30, patch=5),
    "siglip": dict(template=CHATML_TEMPLATE, bos=None, size=28, patch=7),
}


def save_llava_processor(path: Path, kind: str, transformers4: bool = False) -> str:
    """A folder as transformers writes it for a LlavaProcessor (plus a LlavaConfig).
    `transformers4`: the layout transformers 4.x writes instead (transformers_4_layout)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        CLIPImageProcessor,
        LlavaProcessor,
        PreTrainedTokenizerFast,
        SiglipImageProcessor,
    )

    spec = PROCESSORS[kind]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=LLAVA_SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if spec["bos"]:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec["bos"],
        eos_token="</s>" if kind == "clip" else "<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens=["<image>", "<|im_start|>", "<|im_end|>"],
    )
    size, patch = spec["size"], spec["patch"]
    if kind == "clip":
        images = CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
        vision = CLIPVisionConfig(image_size=size, patch_size=patch)
    else:
        images = SiglipImageProcessor(size={"height": size, "width": size})
        vision = SiglipVisionConfig(image_size=size, patch_size=patch)
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=fast,
        patch_size=patch,
        vision_feature_select_strategy="default" if kind == "clip" else "full",
        # the class token position (llava-1.5-hf's processor_config.json says 1)
        num_additional_image_tokens=1 if kind == "clip" else 0,
        chat_template=spec["template"],
    )
    processor.save_pretrained(str(path))
    config = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(vocab_size=len(fast)),
        image_token_index=fast.convert_tokens_to_ids("<image>"),
    )
    config.save_pretrained(str(path))
    if transformers4:
        transformers_4_layout(path)
    return str(path)


def transformers_4_layout(path: Path) -> None:
    """Rewrite a processor folder of transformers 5 into the layout transformers 4.x writes: the
    image processor in preprocessor_config.json, the template in chat_template.json,
    special_tokens_map.json (the pad token) beside tokenizer_config.json (without it)."""
    config = json.loads((path / "processor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(config.pop("image_processor")))
    (path / "processor_config.json").write_text(json.dumps(config))
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = json.loads((path / "tokenizer_config.json").read_text())
    pad = tokenizer.pop("pad_token")
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (path / "special_tokens_map.json").write_text(json.dumps({"pad_token": pad}))


def save_sentencepiece_tokenizer(path: Path) -> None:
    """A tokenizer.json as transformers 4.x writes Llama 2's: byte-fallback BPE behind a
    "Prepend ▁" normalizer (which prepends after every special token too), BOS added; trained
    on CORPUS with LLAVA_SPECIALS and the 256 byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=500, special_tokens=LLAVA_SPECIALS + bytes_)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.save(str(path / "tokenizer.json"))


# folder kind -> (its processor files: PROCESSORS, its decoder)
LLAVA_FOLDERS = {
    "clip_llama3": ("clip", "llama3"),  # LLaVA-1.5's tower with Llama 3.1's RoPE scaling
    "siglip_qwen2_tied": ("siglip", "qwen2"),  # q/k/v biases, tied embeddings, ChatML
    "siglip_qwen3": ("siglip", "qwen3"),  # q/k norms, head_dim != hidden / heads
    "clip_mistral": ("clip", "mistral"),  # linear RoPE scaling, no projector bias
}


def save_llava_folder(path: Path, kind: str) -> Path:
    """save_llava_processor's files, then a tiny random LLaVA model whose config matches them
    (image size and patch, vocabulary, special token ids)."""
    processor, decoder = LLAVA_FOLDERS[kind]
    save_llava_processor(path, processor)
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in tok["added_tokens"]}
    text = dict(TEXT, vocab_size=len(tok["model"]["vocab"]))
    text.update(pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"])
    text["eos_token_id"] = vocab["</s>" if processor == "clip" else "<|im_end|>"]
    top: dict = {}
    if decoder == "llama3":
        text_config = LlamaConfig(**text, rope_parameters=LLAMA3)
    elif decoder == "mistral":
        linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        text_config = MistralConfig(**text, sliding_window=None, rope_parameters=linear)
        top = dict(multimodal_projector_bias=False)
    elif decoder == "qwen2":
        text_config = Qwen2Config(**text, tie_word_embeddings=True)
        top = dict(tie_word_embeddings=True, projector_hidden_act="gelu_pytorch_tanh")
    else:
        text_config = Qwen3Config(**text, head_dim=16)
    if processor == "clip":
        vision = CLIPVisionConfig(**{**TOWER, "image_size": 30, "patch_size": 5})
    else:
        vision = SiglipVisionConfig(**{**TOWER, "image_size": 28, "patch_size": 7})
        top.update(vision_feature_layer=-1, vision_feature_select_strategy="full")
    save_llava(path, vision, text_config, image_token_index=vocab["<image>"], **top)
    return path
