"""Loading Hugging Face folders in one process (models/build.py, models/hf_export.py): separate
towers, and every way a folder can be wrong ends in one line naming the file, tensor or key."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hf_folders import save_llava_folder, save_towers
from safetensors import safe_open

from titan_vlm.config import ConfigError, JobConfig
from titan_vlm.data import model_inputs
from titan_vlm.errors import ConfigError as LeafConfigError
from titan_vlm.models.build import load_hf
from titan_vlm.models.hf_export import export_hf, hf_config, load_hf_model
from titan_vlm.models.llava.model import VLM
from titan_vlm.models.llava.parallelize import apply_ac
from titan_vlm.models.llava.spec import init_rule
from titan_vlm.models.loading import canonical_parameters, init_from_seed
from titan_vlm.models.registry import model_spec
from titan_vlm.validate import validate_job

transformers = pytest.importorskip("transformers")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def separate(vision: Path, text: Path, flavor: str = "hf") -> JobConfig:
    cfg = JobConfig()
    cfg.model.flavor = flavor
    cfg.model.hf_vision_path, cfg.model.hf_text_path = str(vision), str(text)
    return cfg


def test_separate_towers_load_and_the_projector_starts_from_the_seed(tmp_path):
    vision, text = save_towers(tmp_path)
    cfg = separate(vision, text)
    model, args = load_hf_model(cfg)
    params = dict(model.named_parameters())
    v, t = tensors(vision), tensors(text)
    assert torch.equal(
        params["vision.layers.1.attn.q.weight"], v["encoder.layers.1.self_attn.q_proj.weight"]
    )
    assert torch.equal(params["decoder.tok_embeddings.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(params["decoder.output.weight"], t["lm_head.weight"])
    # the projector is what a from-scratch run at the same seed draws for it
    projector = {n for n in params if n.startswith("projector.")}
    with torch.device("meta"):
        fresh = VLM(args)
    fresh.to_empty(device="cpu")
    init_from_seed(fresh, cfg.training.seed, lambda n, p: init_rule(args, n, p), projector)
    drawn = dict(fresh.named_parameters())
    assert projector and all(torch.equal(params[n], drawn[n]) for n in projector)
    assert float(params["projector.fc1.weight"].detach().abs().max()) > 0


def test_activation_checkpointing_loads_the_same_weights(tmp_path):
    """The checkpoint wrapper renames the blocks' parameters (`_checkpoint_wrapped_module.`);
    the adapter's names are the unwrapped ones (models/loading.py canonical_name). Before: a
    KeyError for the first wrapped parameter."""
    vision, text = save_towers(tmp_path)
    cfg = separate(vision, text)
    plain, args = load_hf_model(cfg)
    spec = model_spec(cfg)
    with torch.device("meta"):
        wrapped = VLM(args)
    apply_ac(wrapped, "selective")
    wrapped.to_empty(device="cpu")
    spec.after_to_empty(wrapped)
    load_hf(wrapped, spec, args, cfg)
    got, want = canonical_parameters(wrapped), dict(plain.named_parameters())
    assert any("_checkpoint_wrapped_module." in n for n, _ in wrapped.named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_built_in_flavor_must_match_the_folder(tmp_path):
    vision, text = save_towers(tmp_path)
    with pytest.raises(
        ConfigError, match=r"model.flavor='debug' does not match .* set model.flavor = 'hf'"
    ):
        load_hf_model(separate(vision, text, flavor="debug"))
    assert ConfigError is LeafConfigError  # one error type, from the leaf module


def test_broken_folders_are_one_line_errors(tmp_path):
    vision, text = save_towers(tmp_path)
    cfg = separate(vision, text)
    weights = text / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated in the middle of the tensors
    with pytest.raises(ConfigError, match=r"model.hf_text_path: .*model.safetensors"):
        load_hf_model(cfg)
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ConfigError, match=r"model.hf_text_path: .*is not a safetensors file"):
        load_hf_model(cfg)
    weights.unlink()
    with pytest.raises(ConfigError, match=r"model.hf_text_path: .* has neither model.safetensors"):
        load_hf_model(cfg)
    (text / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
        )
    )
    with pytest.raises(ConfigError, match=r"names missing shard\(s\) model-00001-of-00002"):
        load_hf_model(cfg)
    (text / "config.json").write_text("{broken")
    with pytest.raises(ConfigError, match=r"model.hf_text_path: .*config.json is not JSON"):
        load_hf_model(cfg)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    vision, text = save_towers(tmp_path)
    config = json.loads((text / "config.json").read_text())
    config["intermediate_size"] = 2 * config["intermediate_size"]
    (text / "config.json").write_text(json.dumps(config))
    wrong = (
        r"'model.layers.0.mlp.gate_proj.weight' has shape \(64, 32\), "
        r"decoder.layers.0.feed_forward.w1.weight needs \(128, 32\)"
    )
    with pytest.raises(ConfigError, match=wrong):
        load_hf_model(separate(vision, text))


def test_model_safetensors_wins_over_an_index_beside_it_as_in_transformers(tmp_path):
    """A folder holding both model.safetensors and an index whose shard differs (an old export
    left beside a new one): transformers loads model.safetensors, so titan_vlm does too."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    vision, text = save_towers(tmp_path)
    stale = {k: v + 1.0 for k, v in tensors(text).items()}
    save_file(stale, str(text / "model-00001-of-00001.safetensors"))
    weight_map = dict.fromkeys(stale, "model-00001-of-00001.safetensors")
    (text / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = load_hf_model(separate(vision, text))
    theirs = LlamaForCausalLM.from_pretrained(text).state_dict()["model.embed_tokens.weight"]
    ours = dict(model.named_parameters())["decoder.tok_embeddings.weight"]
    assert torch.equal(ours, theirs) and torch.equal(
        ours, tensors(text)["model.embed_tokens.weight"]
    )
    assert not torch.equal(ours, stale["model.embed_tokens.weight"])  # control: the shard differs


def test_an_integer_tensor_where_a_float_belongs_is_named(tmp_path):
    from safetensors.torch import save_file

    vision, text = save_towers(tmp_path)
    weights = tensors(text)
    weights["model.norm.weight"] = weights["model.norm.weight"].round().to(torch.int64)
    save_file(weights, str(text / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"^model.hf_text_path: tensor 'model.norm.weight' has dtype I64, not a"
    ):
        load_hf_model(separate(vision, text))


def test_export_hf_needs_a_source_folder(tmp_path):
    cfg = JobConfig()  # the debug flavor, from scratch
    with pytest.raises(
        ConfigError, match=r"--export-hf writes the format of the folder .* use --export"
    ):
        export_hf(torch.nn.Linear(1, 1), cfg, tmp_path / "out")
    assert hf_config(str(tmp_path)).model.flavor == "hf"


@contextlib.contextmanager
def unreadable(path: Path):
    """`path` with no permissions, read by a user that is not its owner: as root (root reads any
    file), this process's effective user is 'nobody' inside the block. Everything the block
    imports must be imported before (/root, where Python lives, is closed to 'nobody')."""
    path.chmod(0)
    root = os.geteuid() == 0
    if root:
        os.seteuid(65534)
    try:
        yield
    finally:
        if root:
            os.seteuid(0)
        path.chmod(0o644)


@pytest.fixture
def open_folder():
    """A LLaVA folder 'nobody' may enter (pytest's tmp_path is closed to other users)."""
    folder = Path(tempfile.mkdtemp(prefix="titan_vlm_hf_"))
    folder.chmod(0o755)
    yield save_llava_folder(folder / "llava", "clip_llama3")
    shutil.rmtree(folder)


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "tokenizer_config.json",
        "tokenizer.json",
        "chat_template.jinja",
        "processor_config.json",
        "model.safetensors",
    ],
)
def test_an_unreadable_file_of_a_folder_is_one_line(open_folder, name):
    cfg = JobConfig()
    cfg.model.flavor, cfg.model.hf_path = "hf", str(open_folder)
    validate_job(cfg, 1)  # imports what the reads below need, while it can
    model_inputs(cfg)
    load_hf_model(cfg)
    with unreadable(open_folder / name), pytest.raises(ConfigError) as error:
        validate_job(cfg, 1)
        model_inputs(cfg)
        load_hf_model(cfg)  # the trainer's and generate --hf-path's loading
    message = str(error.value)
    assert message == f"model.hf_path: {open_folder / name} cannot be read (Permission denied)"


def test_a_file_where_the_folder_belongs_is_one_line(tmp_path):
    image = tmp_path / "cat.png"
    image.write_bytes(b"\x89PNG\r\n")
    cfg = JobConfig()
    cfg.model.flavor, cfg.model.hf_path = "hf", str(image)
    with pytest.raises(
        ConfigError, match=rf"^model.hf_path: {image} is a file, not a model folder"
    ):
        validate_job(cfg, 1)
    config = tmp_path / "llava" / "config.json"
    config.mkdir(parents=True)  # a folder where config.json belongs
    cfg.model.hf_path = str(config.parent)
    with pytest.raises(ConfigError, match=rf"^model.hf_path: {config} is a folder, not a file$"):
        validate_job(cfg, 1)


def test_an_export_the_disk_cannot_take_is_one_line_and_leaves_the_folder(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: the write fails with EFBIG as a full disk
    fails with ENOSPC) stops the weights' write: one line, and the earlier export in `out` is
    left as it was, without a half-written folder beside it."""
    import resource
    import signal

    folder = save_llava_folder(tmp_path / "llava", "clip_llama3")
    model, _ = load_hf_model(hf_config(str(folder)))
    out = tmp_path / "out"
    export_hf(model, hf_config(str(folder)), out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # another model to export over it
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))
    try:
        with pytest.raises(ConfigError, match=rf"^--export-hf: cannot write .*; {out} is left"):
            export_hf(model, hf_config(str(folder)), out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llava", "out"]
