"""training.freeze and the per-group learning rates (training.vision_lr / projector_lr), through
the real Trainer (dist_checks.freeze_run): a frozen group's parameters leave training bit for
bit as they entered it, get no gradient and no optimizer state, and a frozen vision tower's
blocks run no backward; training the rest is as exact under CP as without it. The negative
control trains everything and sees every group move and the tower's backward run."""

from __future__ import annotations

import hashlib

import pytest
from safetensors.torch import load_file

from titan_vlm.checkpoint import export_safetensors
from titan_vlm.config import ConfigError, JobConfig
from titan_vlm.validate import validate_job

STEPS = 3
COMMON = dict(
    training__warmup_steps=1,
    training__seq_len=96,
    training__local_batch_size=2,
    metrics__enable_tensorboard=False,
    checkpoint__enable=False,
)
LLAVA_PROJECTOR_PARAMS = 4  # projector.fc1 and fc2, weight and bias


def losses(result: dict) -> list[float]:
    return [h["loss"] for h in result["history"]]


def test_llava_first_stage_trains_only_the_projector_exactly_under_cp(pool, tmp_path):
    """LLaVA's first stage ("vision,decoder" frozen) at cp = 2 (FSDP over the CP ranks) and on
    one process: only the projector moves, nothing frozen gets a gradient or optimizer state,
    the ViT's backward never runs, and the two layouts train the same losses."""
    run = dict(COMMON, training__freeze="vision,decoder")
    cp2 = pool.run(
        "freeze_run", dp_shard=1, cp=2, steps=STEPS, job__dump_folder=str(tmp_path / "a"), **run
    )
    one = pool.run(
        "freeze_run", dp_shard=1, cp=1, steps=STEPS, job__dump_folder=str(tmp_path / "b"), **run
    )[0]
    for result in [*cp2, one]:
        assert result["unchanged"] == {"vision": True, "projector": False, "decoder": True}
        assert result["vision_backward_calls"] == 0
        assert not result["frozen_grads"]
        assert result["optimizer_params"] == LLAVA_PROJECTOR_PARAMS
    assert losses(cp2[0]) == pytest.approx(losses(one), rel=1e-5)
    assert losses(one)[-1] < losses(one)[0]  # the projector alone still learns


def test_frozen_groups_are_exported_bit_for_bit(pool, tmp_path):
    """The checkpoint's export (python -m titan_vlm.checkpoint --export) holds every frozen
    tensor with the bytes it had before training."""
    run = dict(COMMON, training__freeze="vision,decoder", checkpoint__enable=True)
    result = pool.run(
        "freeze_run", dp_shard=1, cp=2, steps=2, job__dump_folder=str(tmp_path), **run
    )[0]
    export_safetensors(tmp_path / "checkpoint", tmp_path / "model.safetensors")
    exported = load_file(tmp_path / "model.safetensors")
    digests = {n: hashlib.sha256(exported[n].numpy().tobytes()).hexdigest() for n in exported}
    frozen = result["frozen_digests"]
    assert frozen and all(n.startswith(("vision.", "decoder.")) for n in frozen)
    assert {n: digests[n] for n in frozen} == frozen
    moved = [n for n in exported if n.startswith("projector.")]
    assert moved and all(n not in frozen for n in moved)


def test_negative_control_nothing_frozen_moves_every_group(pool, tmp_path):
    result = pool.run(
        "freeze_run", dp_shard=1, cp=1, steps=2, job__dump_folder=str(tmp_path), **COMMON
    )[0]
    assert result["unchanged"] == {"vision": False, "projector": False, "decoder": False}
    assert result["vision_backward_calls"] > 0


def test_a_frozen_tower_under_cp_vision_broadcast(pool, tmp_path):
    """cp_vision = "broadcast" with every module before the embeddings frozen: no rank joins
    the embeddings' backward reduce (rank 0 has no gradient to send), so nothing waits, and the
    decoder trains as on one process."""
    run = dict(COMMON, training__freeze="vision,projector", parallelism__cp_vision="broadcast")
    cp2 = pool.run(
        "freeze_run", dp_shard=1, cp=2, steps=STEPS, job__dump_folder=str(tmp_path / "a"), **run
    )
    one = pool.run(
        "freeze_run", dp_shard=1, cp=1, steps=STEPS, job__dump_folder=str(tmp_path / "b"), **run
    )[0]
    for result in cp2:
        assert result["unchanged"] == {"vision": True, "projector": True, "decoder": False}
        assert not result["frozen_grads"]
    assert losses(cp2[0]) == pytest.approx(losses(one), rel=1e-5)


def test_qwen_merger_is_the_projector_group_and_fsdp_units_may_mix(pool, tmp_path):
    """Qwen2.5-VL's patch merger is its "projector": freezing "vision" trains the merger, which
    sits in one FSDP unit with the frozen patch embedding (dp_shard = 2): FSDP reduces the
    merger's gradients only, and the run equals one process."""
    run = dict(COMMON, model__name="qwen2_5_vl", training__freeze="vision")
    fsdp = pool.run(
        "freeze_run", dp_shard=2, cp=1, steps=STEPS, job__dump_folder=str(tmp_path / "a"), **run
    )
    one_process = {**run, "training__local_batch_size": 4}  # the same global rows
    one = pool.run(
        "freeze_run",
        dp_shard=1,
        cp=1,
        steps=STEPS,
        job__dump_folder=str(tmp_path / "b"),
        **one_process,
    )[0]
    for result in fsdp:
        assert result["unchanged"] == {"vision": True, "projector": False, "decoder": False}
        assert result["vision_backward_calls"] == 0
        assert not result["frozen_grads"]
    assert losses(fsdp[0]) == pytest.approx(losses(one), rel=1e-5)


def test_per_group_learning_rates_share_the_schedule(pool, tmp_path):
    run = dict(COMMON, training__vision_lr=1e-4, training__projector_lr=5e-3)
    result = pool.run(
        "freeze_run", dp_shard=1, cp=1, steps=STEPS, job__dump_folder=str(tmp_path), **run
    )[0]
    assert result["optimizer_lrs"] == {"lr": 1e-3, "lr_vision": 1e-4, "lr_projector": 5e-3}
    for h in result["history"]:  # warmup then cosine, the same factor for every group
        assert h["lr_vision"] == pytest.approx(h["lr"] / 10)
        assert h["lr_projector"] == pytest.approx(h["lr"] * 5)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("freeze", "vision,tower", "tower is not a parameter group"),
        ("freeze", "vision, projector ,decoder", "freezes every parameter"),
        ("vision_lr", -1.0, "training.vision_lr must be >= 0"),
    ],
)
def test_bad_freeze_keys_are_one_line(key, value, message):
    cfg = JobConfig()
    setattr(cfg.training, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_job(cfg, 1)


def test_a_rate_for_a_frozen_group_is_refused():
    cfg = JobConfig()
    cfg.training.freeze = "projector"
    cfg.training.projector_lr = 1e-4
    with pytest.raises(ConfigError, match="training.projector_lr=0.0001 is for a group"):
        validate_job(cfg, 1)


def test_frozen_decoder_with_tensor_parallelism_compiled(pool, tmp_path):
    """A frozen decoder under TP (its parameters DTensors on tp) with every block compiled
    (aot_eager, fullgraph): the vision tower and projector train as on one eager process."""
    run = dict(COMMON, training__freeze="decoder")
    tp2 = pool.run(
        "freeze_run",
        dp_shard=1,
        cp=1,
        tp=2,
        steps=STEPS,
        compile__enable=True,
        compile__backend="aot_eager",
        job__dump_folder=str(tmp_path / "a"),
        **run,
    )
    one = pool.run(
        "freeze_run", dp_shard=1, cp=1, steps=STEPS, job__dump_folder=str(tmp_path / "b"), **run
    )[0]
    for result in tp2:
        assert result["unchanged"] == {"vision": False, "projector": False, "decoder": True}
        assert not result["frozen_grads"]
    assert losses(tp2[0]) == pytest.approx(losses(one), rel=1e-5)
