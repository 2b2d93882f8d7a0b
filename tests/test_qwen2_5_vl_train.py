"""The user's commands on a Qwen2.5-VL folder that transformers wrote: ./run_train.sh with
model.flavor = "hf" and model.hf_path trains it at CP=2 on the built-in data (images of one
window, M-RoPE positions per sample), and its first step's loss equals one process's loss of the
same batch, computed here from the folder through the family's ModelSpec and forward_local; the
checkpoint exports (--export-hf) to a folder transformers' from_pretrained loads with no missing
or unexpected tensor, holding the trained weights, and computing what titan_vlm computes."""

import json
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from hf_folders import save_qwen
from transformers import Qwen2_5_VLForConditionalGeneration

from titan_vlm.checkpoint import load_model_for_inference
from titan_vlm.checkpoint import main as export_main
from titan_vlm.config import load_config
from titan_vlm.data import build_dataset
from titan_vlm.data.batch import IGNORE_INDEX
from titan_vlm.models.qwen2_5_vl.model import from_hf_folder
from titan_vlm.models.registry import model_spec
from titan_vlm.parallel.context_parallel import CPContext

ROOT = Path(__file__).resolve().parents[1]


def test_cp2_trains_a_qwen_folder_from_its_first_step_on(tmp_path):
    folder = tmp_path / "qwen"
    save_qwen(folder)
    overrides = [
        "--model.flavor=hf",
        f"--model.hf_path={folder}",
        "--training.steps=3",
        f"--job.dump_folder={tmp_path / 'run'}",
    ]
    out = subprocess.run(
        ["./run_train.sh", "--config", "train_configs/vlm_cp.toml", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"model qwen2_5_vl {folder}:" in out.stdout
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]

    cfg = load_config(["--config", str(ROOT / "train_configs/vlm_cp.toml"), *overrides])
    spec = model_spec(cfg)
    args = spec.args(cfg)
    rule, slot_data = spec.data_rule(args, cfg)
    data = build_dataset(cfg, args, *spec.inputs(cfg), rule=rule, slot_data=slot_data)
    batch = data.batch(0, 0, 1, cfg.training.local_batch_size)
    model = from_hf_folder(folder)
    with torch.no_grad():
        logits, labels, _ = model.forward_local(batch, CPContext())
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert abs(steps[0]["loss"] - want.item()) / want.item() < 1e-5, (steps[0]["loss"], want)

    # the trained checkpoint, exported to the source's format, loads in transformers
    export = tmp_path / "exported"
    # the export command (its main, in this process: tests/test_checkpoint_damage.py runs it)
    export_main(["--export-hf", str(tmp_path / "run" / "checkpoint"), str(export)])
    hf, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    trained, _ = load_model_for_inference(tmp_path / "run" / "checkpoint")
    source = from_hf_folder(folder)
    name = "decoder.layers.0.attention.wq.weight"
    theirs = dict(hf.named_parameters())["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(theirs, dict(trained.named_parameters())[name])
    assert not torch.equal(theirs, dict(source.named_parameters())[name])  # it did train
    qkv = dict(hf.named_parameters())["model.visual.blocks.0.attn.qkv.weight"]  # q, k, v fused
    parts = [dict(trained.named_parameters())[f"vision.layers.0.attn.{n}.weight"] for n in "qkv"]
    assert torch.equal(qkv, torch.cat(parts))
    exported = from_hf_folder(export)
    with torch.no_grad():
        ours, _, _ = exported.forward_local(batch, CPContext())
        again, _, _ = trained.forward_local(batch, CPContext())
    assert torch.equal(ours, again)
