"""Gradient accumulation (training.global_batch_size), through the real Trainer
(dist_checks.accumulation_run): a step of 2 microbatches of 1 row per dp rank is the step of 2
rows at once (every step's loss, and every parameter after the steps), at cp = 2 and under
FSDP (whose gradient reduction then runs once per step). The negative control normalises each
microbatch by its own loss tokens (a mean of means) and must differ."""

from __future__ import annotations

import pytest
import torch

from titan_vlm.config import ConfigError, JobConfig
from titan_vlm.validate import validate_job

STEPS = 3
COMMON = dict(
    training__warmup_steps=1,
    training__seq_len=96,
    metrics__enable_tensorboard=False,
    checkpoint__enable=False,
    data__packing=True,  # rows of different loss-token counts: a mean of means differs
)


def worst_param_error(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-12)) for n in b)


def run(pool, tmp_path, name: str, **kw) -> dict:
    kw = {**COMMON, **kw, "job__dump_folder": str(tmp_path / name)}
    return pool.run("accumulation_run", steps=STEPS, **kw)[0]


@pytest.mark.parametrize("dp_shard, cp", [(1, 2), (2, 1)], ids=["cp2", "fsdp2"])
def test_accumulated_microbatches_take_the_big_step(pool, tmp_path, dp_shard, cp):
    layout = dict(dp_shard=dp_shard, cp=cp)
    big = run(pool, tmp_path, "big", training__local_batch_size=2, **layout)
    rows = 2 * dp_shard  # the job's rows per step
    accumulated = run(
        pool, tmp_path, "acc", training__local_batch_size=1, training__global_batch_size=rows,
        **layout,
    )  # fmt: skip
    losses = [h["loss"] for h in accumulated["history"]]
    assert losses == pytest.approx([h["loss"] for h in big["history"]], rel=1e-5)
    assert [h["ntokens"] for h in accumulated["history"]] == [h["ntokens"] for h in big["history"]]
    assert worst_param_error(accumulated["params"], big["params"]) < 1e-5

    control = run(
        pool, tmp_path, "control", training__local_batch_size=1,
        training__global_batch_size=rows, microbatch_normaliser=True, **layout,
    )  # fmt: skip
    assert worst_param_error(control["params"], big["params"]) > 1e-4
    assert not torch.equal(
        torch.tensor(losses), torch.tensor([h["loss"] for h in control["history"]])
    )


def test_a_global_batch_that_does_not_split_is_one_line():
    cfg = JobConfig()
    cfg.training.local_batch_size = 2
    cfg.training.global_batch_size = 3
    with pytest.raises(ConfigError, match="training.global_batch_size=3 must be 0 or a multiple"):
        validate_job(cfg, 1)
