"""The user's command: ./run_train.sh --config train_configs/vlm_cp.toml [overrides]."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_recipes import RECIPES

from titan_vlm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "vlm_cp.toml"


def run_train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["./run_train.sh", "--config", f"train_configs/{DEFAULT_CONFIG}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_default_config_trains_and_writes_metrics(tmp_path):
    out = run_train("--training.steps=4", "--metrics.log_freq=2", f"--job.dump_folder={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    stdout = out.stdout
    assert "cp=2" in stdout and re.search(r"cp rank 1: \d+ whole sample\(s\)", stdout)
    assert "cp placement (parallelism.cp_sample_placement=auto, cp_image_tokens=auto)" in stdout
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for s in steps:
        assert {
            "step",
            "loss",
            "grad_norm",
            "lr",
            "tokens_per_sec",
            "ntokens",
            "peak_memory_gib",
            "cp_balance",
            "cp_padding",
            "cp_split_samples",
            "cp_whole_samples",
            "cp_replicated_images",
            "cp_sharded_images",
            "step_time_s",
            "data_wait_s",
        } <= s.keys()
        assert 0 < s["data_wait_s"] < s["step_time_s"]
        assert 1.0 <= s["cp_balance"] <= 1.10
        assert 0.0 <= s["cp_padding"] <= 0.05
        assert s["loss"] > 0 and s["tokens_per_sec"] > 0 and s["ntokens"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert "step     2 | loss" in stdout and "step     4 | loss" in stdout  # every log_freq steps
    assert re.search(r"step     4 \| loss .* \| data_wait \d+\.\d{3} s", stdout)
    assert "step     3 | loss" not in stdout  # ... while metrics.jsonl has every step


def test_config_error_stops_before_torchrun(tmp_path):
    out = run_train("--training.stepz=4", f"--job.dump_folder={tmp_path}")
    assert out.returncode != 0
    assert "config error: command line: unknown key 'training.stepz'" in out.stderr
    assert "torchrun" not in out.stderr and not (tmp_path / "metrics.jsonl").exists()


def test_nproc_that_does_not_match_the_degrees_fails_in_one_line(tmp_path):
    out = run_train("--training.steps=1", f"--job.dump_folder={tmp_path}", env={"NPROC": "3"})
    assert out.returncode != 0
    assert (
        out.stderr.strip().startswith("config error:") and "but the world size is 3" in out.stderr
    )
    assert out.stderr.strip().count("\n") == 0, out.stderr  # before torchrun: no per-rank traces


# Every config but those whose runs are other tests' (each config is launched once): the default,
# test_default_config_trains_and_writes_metrics; vlm_fsdp_cp.toml, test_multinode.py's one-node
# run; the recipes, which name Hugging Face folders and dataset files, test_recipes.py on tiny
# folders.
RUN_ELSEWHERE = (DEFAULT_CONFIG, "vlm_fsdp_cp.toml", *RECIPES)
OTHER_CONFIGS = sorted(
    p.name for p in (ROOT / "train_configs").glob("*.toml") if p.name not in RUN_ELSEWHERE
)


@pytest.mark.parametrize("config", OTHER_CONFIGS)
def test_every_other_train_config_runs(config, pool, tmp_path):
    """Loaded, validated and trained for 2 steps as train.py does, on the test pool's processes
    (its degrees' product of them); the launcher itself is the other tests' (run_train.sh)."""
    argv = ["--config", str(ROOT / "train_configs" / config), "--training.steps=2"]
    argv += ["--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path}"]
    p = load_config(argv).parallelism
    degrees = dict(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
    )
    run = pool.run("config_run", argv=argv, **degrees)[0]
    assert [h["step"] for h in run["history"]] == [1, 2]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
