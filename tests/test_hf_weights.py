"""Hugging Face-named safetensors (written by the test with the public names) load into
titan_vlm's modules exactly; a wrong shape or a missing tensor fails naming the tensor."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_vlm.config import ConfigError, load_config
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.models.flavors import get_flavor
from titan_vlm.models.hf_weights import load_hf_weights, save_hf_weights
from titan_vlm.models.vlm import VLM
from titan_vlm.parallel.context_parallel import shard_batch
from titan_vlm.parallel_dims import ParallelDims


def model(seed: int, flavor: str = "debug") -> VLM:
    torch.manual_seed(seed)
    return VLM(get_flavor(flavor))


def test_loading_hf_names_gives_the_same_outputs(tmp_path):
    source, target = model(0), model(1)
    save_hf_weights(source, str(tmp_path / "vision.safetensors"), str(tmp_path / "text.safetensors"))
    names = load_file(str(tmp_path / "text.safetensors")).keys()
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    vision = load_file(str(tmp_path / "vision.safetensors"))
    assert "vision_model.encoder.layers.1.self_attn.k_proj.bias" in vision
    assert vision["vision_model.embeddings.position_embedding.weight"].shape == (16, 64)
    # q/k/v are separate tensors on both sides (the ViT is unfused so that TP splits whole heads)
    assert torch.equal(vision["vision_model.encoder.layers.0.self_attn.v_proj.weight"],
                       source.vision.layers[0].attn.v.weight)
    loaded = load_hf_weights(target, str(tmp_path / "vision.safetensors"), str(tmp_path / "text.safetensors"))
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
    save_hf_weights(model(0, "small"), str(tmp_path / "v.safetensors"), str(tmp_path / "t.safetensors"))
    with pytest.raises(ConfigError, match=r"'vision_model.embeddings.patch_embedding.weight' has shape"):
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
