"""The user's commands on a Qwen3-VL-MoE folder that transformers wrote (two sparse layers and a
dense one: every part of the dense Qwen3-VL too): ./run_train.sh with model.flavor = "hf" and
model.hf_path trains it at CP=2 on the built-in data (images of 2 x 2 merge units, M-RoPE
positions per sample, DeepStack features with the embeddings), logs the experts' load, and its
first step's loss (the router's load-balancing loss included) equals one process's loss of the
same batch computed from the folder (the family's model, equal to transformers' in
tests/unit/test_qwen3_vl_model.py and test_moe.py); the checkpoint exports
(--export-hf) to a folder transformers' from_pretrained loads with no missing or unexpected
tensor, holding the trained weights (the DeepStack mergers among them), and computing what
titan_vlm computes. Then the folder is deleted and the same command resumes from the
checkpoint's copies of it, without expert parallelism (the first run split the experts over
its 2 ranks), and its step 4 equals the uninterrupted run's."""

import json
import shutil
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from hf_folders import save_qwen3_moe
from transformers import Qwen3VLMoeForConditionalGeneration

from titan_vlm.checkpoint import load_model_for_inference
from titan_vlm.checkpoint import main as export_main
from titan_vlm.config import load_config
from titan_vlm.data import build_dataset
from titan_vlm.data.batch import IGNORE_INDEX
from titan_vlm.models.common.moe import aux_loss
from titan_vlm.models.qwen3_vl.model import from_hf_folder
from titan_vlm.models.registry import model_spec
from titan_vlm.parallel.context_parallel import CPContext

ROOT = Path(__file__).resolve().parents[1]


def test_cp2_trains_a_qwen3_vl_moe_folder_and_exports_it(tmp_path):
    folder = tmp_path / "qwen3"
    save_qwen3_moe(folder)
    overrides = [
        "--model.flavor=hf",
        f"--model.hf_path={folder}",
        "--training.steps=4",
        "--checkpoint.interval=3",  # steps 3 and 4: the resume below starts from 3
        "--parallelism.expert_parallel_degree=2",  # the experts split over the 2 ranks
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
    assert f"model qwen3_vl {folder}:" in out.stdout
    assert "active per token (top-k of the experts)" in out.stdout
    assert "2 mixture-of-experts layers: 4 experts of width 24, top 2 renormalised" in out.stdout
    assert "| moe aux " in out.stdout and "load max " in out.stdout  # each logged step
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["moe_aux_loss"] > 0 and s["moe_load_max"] >= 1 for s in steps)

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
    router = model.router_stats()
    assert router is not None
    share, aux, _ = aux_loss(router, None)  # the folder's weight, 0.05
    want = want + share
    assert abs(steps[0]["moe_aux_loss"] - aux.item()) < 1e-6
    assert abs(steps[0]["loss"] - want.item()) / want.item() < 1e-5, (steps[0]["loss"], want)

    export = tmp_path / "exported"
    # the export command (its main, in this process: tests/test_checkpoint_damage.py runs it)
    export_main(["--export-hf", str(tmp_path / "run" / "checkpoint"), str(export)])
    hf, info = Qwen3VLMoeForConditionalGeneration.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    trained, _ = load_model_for_inference(tmp_path / "run" / "checkpoint")
    source = from_hf_folder(folder)
    name = "vision.deepstack_mergers.1.fc2.weight"
    theirs = dict(hf.named_parameters())["model.visual.deepstack_merger_list.1.linear_fc2.weight"]
    assert torch.equal(theirs, dict(trained.named_parameters())[name])
    assert not torch.equal(theirs, dict(source.named_parameters())[name])  # it did train
    exported = from_hf_folder(export)
    with torch.no_grad():
        ours, _, _ = exported.forward_local(batch, CPContext())
        again, _, _ = trained.forward_local(batch, CPContext())
    assert torch.equal(ours, again)

    # back to step 3, as a user restarting from an older checkpoint: the run's step 4 is what
    # the resume below must reproduce
    run_ckpt = tmp_path / "run" / "checkpoint"
    shutil.rmtree(run_ckpt / "step-4")
    (run_ckpt / "latest").write_text("3")
    want4 = steps[-1]["loss"]

    # the source folder deleted, the same command resumes without expert parallelism: the
    # launcher's and the workers' checks and the model read the checkpoint's copies (issue 31),
    # not the folder, and the experts saved split over ep = 2 load whole (DCP reshards them)
    shutil.rmtree(folder)
    out = subprocess.run(
        ["./run_train.sh", "--config", "train_configs/vlm_cp.toml", *overrides[:-2]]
        + [overrides[-1]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 3 (the model, tokenizer and processor from its copies of the sources)" in (
        out.stdout
    )
    assert f"model.hf_path {folder} is gone" in out.stdout + out.stderr
    assert "parallelism.expert_parallel_degree 2 -> 1" in out.stdout
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    assert abs(json.loads(lines[-1])["loss"] - want4) < 1e-5 * want4
