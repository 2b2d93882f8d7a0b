"""Launch on more than one node (run_train.sh's NNODES / NPROC / RDZV_ENDPOINT / NODE_RANK), on
one machine: two torchrun agents on the loopback interface meet at a c10d rendezvous."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from titan_vlm.config import ConfigError, launch_shape, load_config
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.models.llava.shapes import plan_shapes
from titan_vlm.plan.memory import state_bytes
from titan_vlm.plan.spec import Layout

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_KEYS = ("NNODES", "NPROC", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "MASTER_ADDR")
# dp_shard=2 x cp=2: FSDP over all four ranks, two CP groups. The config as it is but for the
# step count: the one-node run is also test_train_script.py's "every train config runs" case of
# vlm_fsdp_cp.toml (not launched twice).
STEPS = 2
ARGS = (
    "--config",
    "train_configs/vlm_fsdp_cp.toml",
    f"--training.steps={STEPS}",
    "--metrics.enable_tensorboard=false",
)


def _env(**launch: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    return {**env, **launch}


def _losses(folder: Path) -> list[float]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_two_agents_on_loopback_train_like_one_four_process_node(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = dict(NNODES="2", NPROC="2", RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="test")
    agents = [
        subprocess.Popen(
            ["./run_train.sh", *ARGS, f"--job.dump_folder={tmp_path / 'two_nodes'}"],
            cwd=ROOT,
            env=_env(**launch),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [a.communicate(timeout=600) for a in agents]
    for agent, (_, err) in zip(agents, outs):
        assert agent.returncode == 0, err[-3000:]
    two_out = "".join(out for out, _ in outs)
    assert "mesh: pp=1 dp_replicate=1 dp_shard=2 cp=2 tp=1 on 4 cpu ranks" in two_out

    one = subprocess.run(
        ["./run_train.sh", *ARGS, f"--job.dump_folder={tmp_path / 'one_node'}"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "on 4 cpu ranks" in one.stdout
    two, single = _losses(tmp_path / "two_nodes"), _losses(tmp_path / "one_node")
    print("losses, two agents:", two, "one node:", single)
    assert len(two) == STEPS and two == single  # bit for bit: the same ranks do the same sums

    # the planner's model state is the trainer's log line
    logged = re.search(r"model state per rank: ([\d.]+) GiB", one.stdout).group(1)
    planned = state_bytes(plan_shapes(get_flavor("debug")), Layout(dp_shard=2, cp=2)).total
    assert f"{planned / 2**30:.3f}" == logged


FSDP_CP = ["--config", "train_configs/vlm_fsdp_cp.toml"]  # 4 processes


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, (4, 1)),
        ({"NPROC": "4"}, (4, 1)),
        ({"NNODES": "2", "RDZV_ENDPOINT": "node0:29500"}, (2, 2)),
        ({"NNODES": "2", "NPROC": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0"}, (2, 2)),
    ],
)
def test_launch_shape(env, want):
    assert launch_shape(load_config(FSDP_CP), env) == want


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {"NNODES": "3", "RDZV_ENDPOINT": "n:1"}, "NNODES=3 does not divide the 4 processes"),
        ([], {"NNODES": "0"}, "NNODES must be a positive integer, got '0'"),
        ([], {"NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT=host:port"),
        ([], {"NNODES": "2", "RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT must be host:port"),
        ([], {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "n"}, "NODE_RANK must be in 0..1"),
        ([], {"NNODES": "2", "NODE_RANK": "0"}, "NODE_RANK needs MASTER_ADDR"),
        (
            [
                "--parallelism.tensor_parallel_degree=4",
                "--parallelism.data_parallel_shard_degree=1",
            ],
            {"NNODES": "4", "NPROC": "2", "RDZV_ENDPOINT": "n:1"},
            "tensor_parallel_degree=4 must divide NPROC=2",
        ),
    ],
)
def test_launch_errors_name_the_variable(args, env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        launch_shape(load_config(FSDP_CP + args), env)


def test_world_is_checked_against_the_degrees_before_any_worker(tmp_path):
    out = subprocess.run(
        ["./run_train.sh", *ARGS, f"--job.dump_folder={tmp_path}"],
        cwd=ROOT,
        env=_env(NNODES="2", NPROC="3", RDZV_ENDPOINT="127.0.0.1:1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().startswith("config error:") and "world size is 6" in out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr
