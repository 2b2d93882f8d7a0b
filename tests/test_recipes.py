"""The example recipes in train_configs/ run as written, on tiny folders that transformers wrote
in place of the real checkpoints (and the built-in data in place of the dataset files): LLaVA's
two stages, the second starting from the first's checkpoint (checkpoint.initial_load_path), and
Qwen2.5-VL fine-tuning with its per-group learning rates. Each runs 2 steps at cp=2 with a
global batch of 2 rows in 2 microbatches, validation at step 2 and async checkpoints."""

from pathlib import Path

import pytest
import torch
from hf_folders import save_llava_folder, save_qwen

ROOT = Path(__file__).resolve().parents[1]
# The configs that name Hugging Face folders and dataset files of the user's own
RECIPES = ("llava_stage1_pretrain.toml", "llava_stage2_finetune.toml", "qwen2_5_vl_finetune.toml")
SMALL = [
    "--data.dataset=synthetic",
    "--data.image_root=",
    "--validation.dataset=synthetic",
    "--training.steps=2",
    "--training.seq_len=96",
    "--training.local_batch_size=1",
    "--training.global_batch_size=2",
    "--training.warmup_steps=1",
    "--validation.freq=2",
    "--validation.steps=1",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.interval=2",
]


def recipe(name: str, *overrides: str) -> list[str]:
    return ["--config", str(ROOT / "train_configs" / name), *SMALL, *overrides]


def group(run: dict, name: str, when: str) -> dict[str, torch.Tensor]:
    """The parameters of group `name` of a config_run, "before" or "after" training."""
    params = {n: p for n, p in run[when].items() if run["groups"][n] == name}
    assert params, name
    return params


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_llava_two_stages(pool, tmp_path):
    folder = save_llava_folder(tmp_path / "llava", "clip_llama3")
    # one LLaVA folder in place of the recipe's separate CLIP and Vicuna folders
    model = [f"--model.hf_path={folder}", "--model.hf_vision_path=", "--model.hf_text_path="]
    model.append("--model.tokenizer_path=")
    stage1 = pool.run(
        "config_run",
        argv=recipe("llava_stage1_pretrain.toml", *model, f"--job.dump_folder={tmp_path / 's1'}"),
        cp=2,
    )[0]
    assert [h["step"] for h in stage1["history"]] == [1, 2]
    assert "validation_loss" in stage1["history"][1]
    for name in ("vision", "decoder"):  # frozen: bit for bit
        assert same(group(stage1, name, "before"), group(stage1, name, "after")), name
    assert not same(group(stage1, "projector", "before"), group(stage1, "projector", "after"))

    stage2 = pool.run(
        "config_run",
        argv=recipe(
            "llava_stage2_finetune.toml",
            *model,
            f"--job.dump_folder={tmp_path / 's2'}",
            f"--checkpoint.initial_load_path={tmp_path / 's1' / 'checkpoint'}",
        ),
        cp=2,
    )[0]
    assert same(stage2["before"], stage1["after"])  # stage 2 starts from stage 1's checkpoint,
    seeded = group(stage1, "projector", "before")
    assert not same(group(stage2, "projector", "before"), seeded)  # not from the seed
    assert same(group(stage2, "vision", "before"), group(stage2, "vision", "after"))
    for name in ("projector", "decoder"):
        assert not same(group(stage2, name, "before"), group(stage2, name, "after")), name
    assert (tmp_path / "s2" / "checkpoint" / "latest").read_text().strip() == "2"
    # a restart resumes from stage 2's own checkpoint: stage 1's may be gone by then
    (tmp_path / "s1" / "checkpoint").rename(tmp_path / "s1" / "moved")
    argv = recipe(
        "llava_stage2_finetune.toml",
        *model,
        f"--job.dump_folder={tmp_path / 's2'}",
        f"--checkpoint.initial_load_path={tmp_path / 's1' / 'checkpoint'}",
        "--training.steps=3",
    )
    again = pool.run("config_run", argv=argv, cp=2)[0]
    assert [h["step"] for h in again["history"]] == [3]
    assert same(again["before"], stage2["after"])


def test_llava_stage2_refuses_a_checkpoint_of_another_model(pool, tmp_path):
    first = ["--training.steps=1", "--checkpoint.enable", f"--job.dump_folder={tmp_path / 'a'}"]
    pool.run("config_run", argv=["--config", str(ROOT / "train_configs/vlm_cp.toml"), *first], cp=2)
    folder = save_llava_folder(tmp_path / "llava", "clip_llama3")
    argv = recipe(
        "llava_stage2_finetune.toml",
        f"--model.hf_path={folder}",
        "--model.hf_vision_path=",
        "--model.hf_text_path=",
        "--model.tokenizer_path=",
        f"--job.dump_folder={tmp_path / 'b'}",
        f"--checkpoint.initial_load_path={tmp_path / 'a' / 'checkpoint'}",
    )
    with pytest.raises(RuntimeError, match=r"initial_load_path=.* holds another model: \S+ is"):
        pool.run("config_run", argv=argv, cp=2)


def test_qwen2_5_vl_finetune(pool, tmp_path):
    folder = tmp_path / "qwen"
    save_qwen(folder)
    run = pool.run(
        "config_run",
        argv=recipe(
            "qwen2_5_vl_finetune.toml",
            f"--model.hf_path={folder}",
            "--parallelism.context_parallel_degree=2",
            f"--job.dump_folder={tmp_path / 'run'}",
        ),
        cp=2,
    )[0]
    for h in run["history"]:  # the recipe's rates, on the one schedule
        assert h["lr_vision"] == pytest.approx(h["lr"] / 10, rel=1e-6)
        assert h.get("lr_projector", h["lr"]) == pytest.approx(h["lr"], rel=1e-6)
    for name in ("vision", "projector", "decoder"):  # everything trains
        assert not same(group(run, name, "before"), group(run, name, "after")), name
    assert "validation_loss" in run["history"][1]
