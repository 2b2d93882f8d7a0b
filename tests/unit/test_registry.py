"""Which family a config trains (models/registry.py): model.name, or with model.flavor = "hf" the
model_type of the folder's config.json, as transformers writes it. A folder of a family titan_vlm
does not have is refused in one line naming the file, its model_type and the families."""

from __future__ import annotations

import pytest
from transformers import LlavaConfig, Qwen2_5_VLConfig, Qwen3MoeConfig, Qwen3VLConfig

from titan_vlm.config import JobConfig
from titan_vlm.errors import ConfigError
from titan_vlm.models.registry import MODEL_SPECS, family_name, model_spec


def _cfg(flavor: str, hf_path: str = "") -> JobConfig:
    cfg = JobConfig()
    cfg.model.flavor = flavor  # type: ignore[assignment]
    cfg.model.hf_path = hf_path
    return cfg


def test_every_family_is_named_by_its_spec_and_claims_its_model_types():
    claimed = [t for spec in MODEL_SPECS.values() for t in spec.hf_model_types]
    assert len(claimed) == len(set(claimed))  # a model_type picks one family
    assert all(name == spec.name for name, spec in MODEL_SPECS.items())


def test_a_built_in_flavor_is_the_family_model_name_says():
    assert family_name(_cfg("debug")) == "llava"
    assert model_spec(_cfg("debug")) is MODEL_SPECS["llava"]


def test_an_hf_folder_picks_its_family_by_model_type(tmp_path):
    LlavaConfig().save_pretrained(tmp_path / "llava")
    assert family_name(_cfg("hf", str(tmp_path / "llava"))) == "llava"
    Qwen2_5_VLConfig().save_pretrained(tmp_path / "qwen")
    assert family_name(_cfg("hf", str(tmp_path / "qwen"))) == "qwen2_5_vl"
    Qwen3VLConfig().save_pretrained(tmp_path / "qwen3")
    assert family_name(_cfg("hf", str(tmp_path / "qwen3"))) == "qwen3_vl"


def test_a_folder_of_another_family_is_one_line(tmp_path):
    Qwen3MoeConfig().save_pretrained(tmp_path)  # a text model alone
    with pytest.raises(ConfigError) as e:
        model_spec(_cfg("hf", str(tmp_path)))
    message = str(e.value)
    assert "\n" not in message
    assert f"{tmp_path}/config.json: model_type='qwen3_moe' is not a family" in message
    assert "llava: llava; qwen2_5_vl: qwen2_5_vl; qwen3_vl: qwen3_vl, qwen3_vl_moe" in message


def test_a_built_in_flavor_ignores_a_folders_model_type(tmp_path):
    # a built-in flavor names its family; the folder must then match it (llava_args checks)
    Qwen2_5_VLConfig().save_pretrained(tmp_path)
    assert family_name(_cfg("debug", str(tmp_path))) == "llava"
