"""Hugging Face-named safetensors (written by the test with the public names) load into
titan_vlm's modules exactly; a wrong shape or a missing tensor fails naming the tensor."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_vlm.config import ConfigError, load_config
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.models.flavors import get_flavor, model_args
from titan_vlm.models.hf_weights import load_hf_weights, save_hf_weights
from titan_vlm.models.vlm import VLM
from titan_vlm.parallel.context_parallel import shard_batch
from titan_vlm.parallel_dims import ParallelDims


def model(seed: int, flavor: str = "debug") -> VLM:
    torch.manual_seed(seed)
    return VLM(get_flavor(flavor))


def test_loading_hf_names_gives_the_same_outputs(tmp_path):
    source, target = model(0), model(1)
    save_hf_weights(
        source, str(tmp_path / "vision.safetensors"), str(tmp_path / "text.safetensors")
    )
    names = load_file(str(tmp_path / "text.safetensors")).keys()
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    vision = load_file(str(tmp_path / "vision.safetensors"))
    assert "vision_model.encoder.layers.1.self_attn.k_proj.bias" in vision
    assert vision["vision_model.embeddings.position_embedding.weight"].shape == (16, 64)
    # q/k/v are separate tensors on both sides (the ViT is unfused so that TP splits whole heads)
    assert torch.equal(
        vision["vision_model.encoder.layers.0.self_attn.v_proj.weight"],
        source.vision.layers[0].attn.v.weight,
    )
    loaded = load_hf_weights(
        target, str(tmp_path / "vision.safetensors"), str(tmp_path / "text.safetensors")
    )
    assert sorted(loaded) == sorted(n for n, _ in target.named_parameters())
    batch = SyntheticCaptions(32, 16, 64, seed=0).batch(0, 0, 1, 2)
    tokens, _, layout = shard_batch(batch, None)
    assert torch.equal(source(batch.images, tokens, layout), target(batch.images, tokens, layout))


def test_tied_embeddings_fill_the_output_head(tmp_path):
    source, target = model(0), model(1)
    save_hf_weights(source, str(tmp_path / "v.safetensors"), str(tmp_path / "t.safetensors"))
    text = load_file(str(tmp_path / "t.safetensors"))
    del text["lm_head.weight"]
    save_file(text, str(tmp_path / "t.safetensors"))
    load_hf_weights(target, text_path=str(tmp_path / "t.safetensors"))
    assert torch.equal(target.decoder.output.weight, source.decoder.tok_embeddings.weight)


def test_wrong_shape_names_the_tensor(tmp_path):
    save_hf_weights(
        model(0, "small"), str(tmp_path / "v.safetensors"), str(tmp_path / "t.safetensors")
    )
    with pytest.raises(
        ConfigError, match=r"'vision_model.embeddings.patch_embedding.weight' has shape"
    ):
        load_hf_weights(model(1), vision_path=str(tmp_path / "v.safetensors"))
    with pytest.raises(ConfigError, match=r"'model.embed_tokens.weight' has shape \(264, 256\)"):
        load_hf_weights(model(1), text_path=str(tmp_path / "t.safetensors"))


def test_missing_tensor_and_missing_file(tmp_path):
    save_hf_weights(model(0), str(tmp_path / "v.safetensors"), str(tmp_path / "t.safetensors"))
    text = load_file(str(tmp_path / "t.safetensors"))
    del text["model.layers.2.mlp.up_proj.weight"]
    save_file(text, str(tmp_path / "t.safetensors"))
    with pytest.raises(ConfigError, match=r"'model.layers.2.mlp.up_proj.weight' not found"):
        load_hf_weights(model(1), text_path=str(tmp_path / "t.safetensors"))
    cfg = load_config(["--model.hf_text_path=/no/such.safetensors"])
    with pytest.raises(ConfigError, match=r"model.hf_text_path: file not found"):
        ParallelDims.from_config(cfg, 1).validate_model(cfg)


def write_hf_checkpoint(folder, source: VLM, **text_overrides) -> tuple[str, str]:
    """SigLIP-style vision + Llama-style text checkpoints of `source`, each with its config.json
    (the public key names), in two folders."""
    import json

    v, t = source.args.vision, source.args.decoder
    (folder / "siglip").mkdir()
    (folder / "llama").mkdir()
    vision, text = (
        str(folder / "siglip" / "model.safetensors"),
        str(folder / "llama" / "model.safetensors"),
    )
    save_hf_weights(source, vision, text)
    (folder / "siglip" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "siglip_vision_model",
                "hidden_size": v.dim,
                "intermediate_size": v.mlp_dim,
                "num_hidden_layers": v.n_layers,
                "num_attention_heads": v.n_heads,
                "image_size": v.image_size,
                "patch_size": v.patch_size,
                "num_channels": 3,
                "layer_norm_eps": v.norm_eps,
                "hidden_act": "gelu",
            }
        )
    )
    (folder / "llama" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": t.dim,
                "intermediate_size": t.ffn_dim,
                "num_hidden_layers": t.n_layers,
                "num_attention_heads": t.n_heads,
                "num_key_value_heads": t.n_kv_heads,
                "vocab_size": t.vocab_size,
                "rms_norm_eps": t.norm_eps,
                "rope_theta": t.rope_theta,
                "max_position_embeddings": t.max_seq_len,
                "hidden_act": "silu",
                "rope_scaling": None,
                **text_overrides,
            }
        )
    )
    return vision, text


def test_hf_flavor_takes_the_shapes_from_the_configs(tmp_path):
    """model.flavor = "hf": the architecture comes from the config.json beside each checkpoint,
    so the weights load and give the source model's outputs."""
    source = model(0)
    vision, text = write_hf_checkpoint(tmp_path, source)
    args = model_args("hf", hf_vision_path=vision, hf_text_path=text)
    assert args == get_flavor("debug")
    target = VLM(args)
    load_hf_weights(target, vision, text)
    batch = SyntheticCaptions(32, 16, 64, seed=0).batch(0, 0, 1, 2)
    tokens, _, layout = shard_batch(batch, None)
    assert torch.equal(source(batch.images, tokens, layout), target(batch.images, tokens, layout))
    cfg = load_config(
        ["--model.flavor=hf", f"--model.hf_vision_path={vision}", f"--model.hf_text_path={text}"]
    )
    ParallelDims.from_config(cfg, 1).validate_model(cfg)


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_scaling="),
        ({"model_type": "qwen2"}, "model_type='qwen2' is not supported .Qwen2 has q/k/v biases"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"head_dim": 64}, "head_dim=64 is not supported"),
    ],
)
def test_hf_flavor_refuses_what_the_modules_cannot_express(tmp_path, overrides, words):
    vision, text = write_hf_checkpoint(tmp_path, model(0), **overrides)
    with pytest.raises(ConfigError, match=r"model.flavor='hf': .*llama/config.json: " + words):
        model_args("hf", hf_vision_path=vision, hf_text_path=text)


def test_hf_flavor_needs_both_checkpoints_and_their_configs(tmp_path):
    vision, text = write_hf_checkpoint(tmp_path, model(0))
    with pytest.raises(ConfigError, match="set model.hf_text_path"):
        model_args("hf", hf_vision_path=vision)
    (tmp_path / "siglip" / "config.json").unlink()
    with pytest.raises(
        ConfigError,
        match=r"siglip/config.json not found \(the config.json beside model.hf_vision_path\)",
    ):
        model_args("hf", hf_vision_path=vision, hf_text_path=text)
