"""Real Hugging Face model folders, as transformers itself writes them, load into titan_vlm and
compute what transformers computes.

Each test builds a tiny random model from transformers' config classes (no downloads),
save_pretrained()s it, parses its config.json (models/llava/hf_config.py), loads its safetensors
under the adapter's names (models/llava/hf_adapter.py) and compares fp32 logits with
transformers' own forward on the same prompt: the image's `image_token_index` repeated
tokens_per_image times, as LLaVA's processor expands <image>. Tolerance: max abs difference /
max abs logit < 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_folders import LLAMA3, LLAVA_IMAGE, LLAVA_VOCAB, TEXT, TOWER, save_llava, save_model
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    CLIPConfig,
    CLIPModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    SiglipConfig,
    SiglipModel,
    SiglipVisionConfig,
    SiglipVisionModel,
)

from titan_vlm.config import ConfigError
from titan_vlm.data.batch import Sample, collate
from titan_vlm.layout import build_layout
from titan_vlm.models.common.hf_config import text_args_from_hf
from titan_vlm.models.llava.args import VLMArgs, get_flavor
from titan_vlm.models.llava.hf_adapter import (
    LLAVA_HF4,
    LLAVA_HF5,
    export_names,
    hf_names,
    key_style,
    unused_hf_tensors,
)
from titan_vlm.models.llava.hf_config import args_from_hf_config, vision_args_from_hf
from titan_vlm.models.llava.model import VLM
from titan_vlm.parallel.context_parallel import shard_batch

TOL = 1e-5
VOCAB, IMAGE_TOKEN = LLAVA_VOCAB, LLAVA_IMAGE

FAMILIES = {
    # LLaVA-1.5: CLIP tower at layer -2, class token dropped; Llama 3.1-style RoPE
    "clip_llama3": dict(
        vision=CLIPVisionConfig(**TOWER),
        text=LlamaConfig(**TEXT, rope_parameters=LLAMA3),
    ),
    # a SigLIP + Qwen2 VLM: q/k/v biases, every position, the last layer, tanh-GELU projector
    "siglip_qwen2": dict(
        vision=SiglipVisionConfig(**TOWER),
        text=Qwen2Config(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu_pytorch_tanh",
    ),
    # Qwen3: q/k norms, head_dim 16 != 32 / 4, biases on all four projections; tied embeddings
    "siglip_qwen3_tied": dict(
        vision=SiglipVisionConfig(**TOWER),
        text=Qwen3Config(**TEXT, head_dim=16, attention_bias=True, tie_word_embeddings=True),
        vision_feature_layer=1,
    ),
    # Mistral with linear RoPE scaling, a bias-free projector, quick_gelu -> relu
    "clip_mistral_linear": dict(
        vision=CLIPVisionConfig(**TOWER),
        text=MistralConfig(
            **TEXT,
            sliding_window=None,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
        multimodal_projector_bias=False,
        projector_hidden_act="relu",
        # hidden_states[0]: the embeddings after pre_layrnorm, no block runs (transformers 5.24
        # collects no hidden states for a vision_feature_layer of 0 itself: its falsy test)
        vision_feature_layer=-4,
    ),
    # Llama with attention_bias and mlp_bias
    "siglip_llama_biases": dict(
        vision=SiglipVisionConfig(**TOWER),
        text=LlamaConfig(**TEXT, attention_bias=True, mlp_bias=True),
        vision_feature_select_strategy="full",
        projector_hidden_act="silu",
    ),
}


def file_keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def load_into(model: VLM, folder: Path, keys: set[str] | None = None) -> None:
    """The whole-file load the tests need (the trainer's loader reads per-rank slices)."""
    names = hf_names(model.args, keys or file_keys(folder), str(folder))
    params = dict(model.named_parameters())
    with safe_open(str(folder / "model.safetensors"), "pt") as f, torch.no_grad():
        for ours, theirs in names.items():
            params[ours].copy_(f.get_tensor(theirs))


def titan_llava(folder: Path) -> VLM:
    config = json.loads((folder / "config.json").read_text())
    model = VLM(args_from_hf_config(config, str(folder / "config.json"))).eval()
    load_into(model, folder)
    return model


def prompt(args: VLMArgs, seed: int = 1) -> tuple[list[int], torch.Tensor]:
    """Text, an image, more text: the token ids HF sees and the image."""
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(3, args.vision.image_size, args.vision.image_size, generator=g) * 2 - 1
    before = torch.randint(0, VOCAB - 1, (5,), generator=g).tolist()
    after = torch.randint(0, VOCAB - 1, (7,), generator=g).tolist()
    return [before, after], image


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def compare_llava(hf: LlavaForConditionalGeneration, ours: VLM) -> float:
    """Logits of the text slots of one sample, titan_vlm (batch.py -> shard_batch -> decoder)
    against LlavaForConditionalGeneration(input_ids, pixel_values)."""
    (before, after), image = prompt(ours.args)
    tpi = ours.args.tokens_per_image
    ids = torch.tensor([before + [IMAGE_TOKEN] * tpi + after])
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=image[None]).logits[0]
    batch = collate(
        [[Sample([before, image, after])]], ids.shape[1], tpi, ours.args.vision.image_size, 0
    )
    tokens, _, layout = shard_batch(batch, None)
    index, _ = build_layout(batch.doc, batch.image)
    text = index[0] >= 0
    with torch.no_grad():
        logits = ours.decoder(tokens, layout.place_images(ours.encode_images(batch.images)), layout)
    assert text.sum() == len(before) + len(after)
    return relative_error(logits[0][text], theirs[index[0][text]])


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
def test_llava_folder_matches_transformers(tmp_path, family):
    family = dict(family)
    hf = save_llava(tmp_path, family.pop("vision"), family.pop("text"), **family)
    ours = titan_llava(tmp_path)
    err = compare_llava(hf, ours)
    print(f"relative logit error {err:.2e}")
    assert err < TOL


def test_llava_args_follow_the_config(tmp_path):
    save_llava(tmp_path, **FAMILIES["clip_llama3"])
    config = json.loads((tmp_path / "config.json").read_text())
    args = args_from_hf_config(config, "config.json")
    v, d = args.vision, args.decoder
    # layer -2 of 3: hidden_states[2], two blocks run; 16 patches + class token, position 0 dropped
    assert (v.n_layers, v.source_layers, v.post_norm) == (2, 3, False)
    assert (v.class_token, v.pre_norm, v.patch_bias, v.act) == (True, True, False, "quick_gelu")
    assert args.tokens_per_image == 16 and args.image_token_id == IMAGE_TOKEN
    assert d.rope.type == "llama3" and d.rope_theta == 500000.0 and d.max_seq_len == 2048
    config["vision_feature_select_strategy"] = "full"
    assert args_from_hf_config(config, "config.json").tokens_per_image == 17


def test_tied_embeddings_are_one_parameter(tmp_path):
    hf = save_llava(tmp_path, **{k: FAMILIES["siglip_qwen3_tied"][k] for k in ("vision", "text")})
    assert not any("lm_head" in k for k in file_keys(tmp_path))
    ours = titan_llava(tmp_path)
    d = ours.decoder
    assert d.output.weight is d.tok_embeddings.weight
    assert "decoder.output.weight" not in dict(ours.named_parameters())
    assert export_names(ours.args)["decoder.tok_embeddings.weight"].endswith("embed_tokens.weight")
    assert compare_llava(hf, ours) < TOL
    # training keeps them tied: both uses' gradients land in the one parameter
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    tokens = torch.randint(0, VOCAB, (1, 6))
    layout = shard_batch(collate([[Sample([tokens[0].tolist()])]], 6, 1, 16, 0), None)[2]
    ours.decoder(tokens, None, layout).sum().backward()
    opt.step()
    assert d.output.weight is d.tok_embeddings.weight


def test_transformers_4_folder_loads(tmp_path):
    """Keys as transformers 4.x and the hub write them (vision_tower.vision_model.*) and a text
    config with top-level rope_theta and rope_scaling {"type": ...}."""
    hf = save_llava(tmp_path, **FAMILIES["clip_mistral_linear"])
    keys = file_keys(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {
            k.replace("vision_tower.", "vision_tower.vision_model."): f.get_tensor(k) for k in keys
        }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config["text_config"].pop("rope_parameters")
    config["text_config"]["rope_theta"] = rope["rope_theta"]
    config["text_config"]["rope_scaling"] = {"type": "linear", "factor": rope["factor"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert key_style(set(tensors)) == LLAVA_HF4
    ours = titan_llava(tmp_path)
    assert ours.args.decoder.rope.factor == 4.0
    assert compare_llava(hf, ours) < TOL
    assert set(export_names(ours.args, LLAVA_HF4).values()) <= set(tensors)


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
def test_every_tensor_is_used_or_reported(tmp_path, family):
    family = dict(family)
    save_llava(tmp_path, family.pop("vision"), family.pop("text"), **family)
    keys = file_keys(tmp_path)
    args = titan_llava(tmp_path).args
    names, unused = hf_names(args, keys), unused_hf_tensors(args, keys)
    assert set(names.values()).isdisjoint(unused)
    assert set(names.values()) | set(unused) == keys
    assert export_names(args, LLAVA_HF5) == names
    assert set(names) == {n for n, _ in VLM(args).named_parameters()}


def test_unused_tensors_and_their_reasons(tmp_path):
    save_llava(tmp_path, **FAMILIES["clip_llama3"])  # layer -2 of 3; CLIP's post_layernorm
    keys = file_keys(tmp_path)
    unused = unused_hf_tensors(titan_llava(tmp_path).args, keys)
    assert {k.split(".")[1] for k in unused} == {"encoder", "post_layernorm"}
    assert all(".layers.2." in k for k in unused if "encoder" in k)
    assert "vision_tower.post_layernorm.weight" in unused


def test_vision_tower_folders_match_last_hidden_state(tmp_path):
    """A plain CLIPVisionModel / SiglipVisionModel folder (5.x writes no prefix; 4.x:
    vision_model.*) gives its last_hidden_state: SigLIP's post_layernorm applied, CLIP's class
    token kept."""
    image = torch.rand(2, 3, 16, 16) * 2 - 1
    for name, cls, config in (
        ("siglip", SiglipVisionModel, SiglipVisionConfig(**TOWER)),
        ("clip", CLIPVisionModel, CLIPVisionConfig(**TOWER)),
    ):
        torch.manual_seed(0)
        hf = save_model(tmp_path / name, cls(config))
        v = vision_args_from_hf(json.loads((tmp_path / name / "config.json").read_text()), name)
        ours = VLM(VLMArgs(vision=v)).eval()
        keys = file_keys(tmp_path / name)
        load_into(ours, tmp_path / name, keys)
        with torch.no_grad():
            err = relative_error(ours.vision(image), hf(pixel_values=image).last_hidden_state)
        assert err < TOL, name
        assert ours.args.tokens_per_image == 16 + (name == "clip")
        # a 4.x tower folder: the same tensors under vision_model.*
        v4 = hf_names(ours.args, {f"vision_model.{k}" for k in keys})
        assert v4.keys() == hf_names(ours.args, keys).keys()


def test_contrastive_model_folders_give_their_vision_tower(tmp_path):
    """A whole CLIPModel / SiglipModel folder (what the hub mostly holds as a separate tower): its
    vision_config and vision_model.* tensors; the text tower and projections are reported."""
    image = torch.rand(2, 3, 16, 16) * 2 - 1
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    for name, cls, config in (
        ("siglip", SiglipModel, SiglipConfig(text_config=text, vision_config=TOWER)),
        ("clip", CLIPModel, CLIPConfig(text_config=text, vision_config=TOWER)),
    ):
        torch.manual_seed(0)
        hf = save_model(tmp_path / name, cls(config))
        v = vision_args_from_hf(json.loads((tmp_path / name / "config.json").read_text()), name)
        ours = VLM(VLMArgs(vision=v)).eval()
        keys = file_keys(tmp_path / name)
        load_into(ours, tmp_path / name, keys)
        unused = unused_hf_tensors(ours.args, keys)
        assert "logit_scale" in unused and "text_model.embeddings.token_embedding.weight" in unused
        with torch.no_grad():
            theirs = hf.vision_model(pixel_values=image).last_hidden_state
            assert relative_error(ours.vision(image), theirs) < TOL, name


def test_causal_lm_folder_matches_transformers(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(**TEXT, rope_parameters=LLAMA3, tie_word_embeddings=True)
    hf = save_model(tmp_path, LlamaForCausalLM(config))
    keys = file_keys(tmp_path)
    assert keys == {k for k in keys if k.startswith("model.")}  # tied: no lm_head
    d = text_args_from_hf(json.loads((tmp_path / "config.json").read_text()), "config.json")
    ours = VLM(VLMArgs(decoder=d)).eval()
    load_into(ours, tmp_path, keys)
    tokens = torch.randint(0, VOCAB, (1, 24))
    layout = shard_batch(collate([[Sample([tokens[0].tolist()])]], 24, 1, 16, 0), None)[2]
    with torch.no_grad():
        err = relative_error(ours.decoder(tokens, None, layout), hf(input_ids=tokens).logits)
    assert err < TOL


def test_meta_build_then_init_weights_reproduces_the_cpu_build(tmp_path):
    for args in (get_flavor("debug"), titan_llava_args(tmp_path)):
        torch.manual_seed(3)
        cpu = VLM(args)
        with torch.device("meta"):
            meta = VLM(args)
        meta.to_empty(device="cpu")
        torch.manual_seed(3)
        meta.init_weights()
        for (name, a), b in zip(cpu.state_dict().items(), meta.state_dict().values()):
            assert torch.equal(a, b), name
        assert torch.equal(cpu.decoder.rope_cos, meta.decoder.rope_cos)


def titan_llava_args(tmp_path: Path) -> VLMArgs:
    save_llava(tmp_path, **{k: FAMILIES["siglip_qwen3_tied"][k] for k in ("vision", "text")})
    return args_from_hf_config(json.loads((tmp_path / "config.json").read_text()), "c")


# --- refusals: one line, naming the file and the key -------------------------------------------


def llava_config(**changes) -> dict:
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**TOWER),
        text_config=LlamaConfig(**TEXT),
        image_token_index=IMAGE_TOKEN,
    ).to_dict()
    for key, value in changes.items():
        section, _, name = key.rpartition("__")
        (config[section] if section else config)[name] = value
    return config


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(vision_feature_layer=[-2, -1]),
            r"c.json: vision_feature_layer=\[-2, -1\] is not supported \(one int layer\)",
        ),
        (dict(vision_feature_layer=-5), r"vision_feature_layer=-5 .*the tower has 3 layers"),
        (dict(vision_feature_select_strategy="cls"), r"vision_feature_select_strategy='cls'"),
        (dict(projector_hidden_act="tanh"), r"projector_hidden_act='tanh' is not supported"),
        (
            dict(text_config__rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            r"c.json: text_config.rope_parameters.rope_type='yarn' is not supported "
            r"\(supported rope types: default, linear, llama3\)",
        ),
        (
            dict(
                text_config__rope_parameters={
                    "rope_type": "linear",
                    "factor": 2.0,
                    "attention_factor": 0.5,
                }
            ),
            r"text_config.rope_parameters.attention_factor=0.5 is not supported",
        ),
        (
            dict(text_config__rope_parameters=None, text_config__rope_scaling={"type": "dynamic"}),
            r"text_config.rope_scaling.type='dynamic' is not supported",
        ),
        (
            dict(model_type="idefics2"),
            r"c.json: model_type='idefics2' is not supported \(supported: llava\)",
        ),
        (
            dict(text_config__model_type="gemma"),
            r"text_config.model_type='gemma' is not supported "
            r"\(supported: llama, mistral, qwen2, qwen3, qwen3_moe\)",
        ),
        (
            dict(vision_config__model_type="dinov2"),
            r"vision_config.model_type='dinov2' is not supported",
        ),
        (dict(text_config__hidden_act="gelu"), r"text_config.hidden_act='gelu' is not supported"),
    ],
)
def test_llava_config_refusals(changes, message):
    with pytest.raises(ConfigError, match=message) as e:
        args_from_hf_config(llava_config(**changes), "c.json")
    assert "\n" not in str(e.value)


def test_sliding_window_refusals():
    mistral = MistralConfig(**TEXT).to_dict()  # transformers' default window: 4096 < 131072
    with pytest.raises(
        ConfigError, match=r"m.json: sliding_window=4096 is not supported \(sliding-window"
    ):
        text_args_from_hf(mistral, "m.json")
    mistral["sliding_window"] = mistral["max_position_embeddings"]  # never slides
    assert text_args_from_hf(mistral, "m.json").max_seq_len == 131072
    for config in (Qwen2Config(**TEXT), Qwen3Config(**TEXT)):
        qwen = config.to_dict()
        qwen["use_sliding_window"] = True
        with pytest.raises(ConfigError, match=r"q.json: use_sliding_window=True is not supp"):
            text_args_from_hf(qwen, "q.json")


def test_4x_rope_scaling_spellings():
    llama = LlamaConfig(**TEXT).to_dict()
    del llama["rope_parameters"]
    llama["rope_theta"] = 5e5
    llama["rope_scaling"] = {**LLAMA3, "rope_type": "llama3"}
    del llama["rope_scaling"]["rope_theta"]
    d = text_args_from_hf(llama, "l.json")
    assert d.rope_theta == 5e5 and d.rope.type == "llama3" and d.rope.factor == 8.0
    llama["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ConfigError, match=r"l.json: rope_scaling.low_freq_factor is missing"):
        text_args_from_hf(llama, "l.json")


def test_a_stray_tensor_is_an_error(tmp_path):
    save_llava(tmp_path, **FAMILIES["clip_llama3"])
    args = titan_llava(tmp_path).args
    keys = file_keys(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"f: tensor 'language_model.model.layers.0.self_attn.extra.weight' is not used",
    ):
        hf_names(args, keys | {"language_model.model.layers.0.self_attn.extra.weight"}, "f")
    with pytest.raises(
        ConfigError,
        match=r"f: tensor 'language_model.model.norm.weight' not found \(needed for decoder.norm",
    ):
        hf_names(args, keys - {"language_model.model.norm.weight"}, "f")
    with pytest.raises(ConfigError, match=r"f: no known tensor-name style"):
        hf_names(args, {"foo.weight"}, "f")


# --- the new module features under the parallel trainer ----------------------------------------

# dist_checks.hf_features_args: a CLIP-style tower cut before its last layer, biases everywhere,
# q/k norms, head_dim != dim / heads, llama3 RoPE and TIED embeddings. Sequence parallelism is
# left out: the tower's 17 positions (class token) do not split over tp = 2.
HF_FEATURE_LAYOUTS = {
    "dp2xcp2": dict(dp_shard=2, cp=2),
    "cp2xtp2": dict(cp=2, tp=2, comm="allgather"),
    "dp2xtp2_replicate_vision": dict(dp_shard=2, tp=2, cp=1, vision="replicate"),
}


@pytest.mark.parametrize("layout", HF_FEATURE_LAYOUTS.values(), ids=HF_FEATURE_LAYOUTS.keys())
def test_hf_features_train_exactly_under_fsdp_cp_tp(pool, layout):
    """One optimizer step with FSDP, CP and TP equals one process, and the tied head stays the
    embedding's Parameter through FSDP's and TP's parameter replacement and the step."""
    from test_parity import mismatches, report

    results = pool.run("parity", hf_features=True, **layout)
    report(str(layout), results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"
        assert result["tied"], f"rank {rank}: the head is no longer the embedding"
