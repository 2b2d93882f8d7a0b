"""Checkpoints: a run that is killed and resumed continues exactly; a checkpoint loads at another
CP degree and from a tensor-parallel layout; the model can be exported and asked about an image."""

import json

import pytest
import torch

from titan_vlm.checkpoint import export_safetensors, latest_step_dir, load_model_for_inference
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.generate import generate, load_image

RUN = dict(
    steps=6,
    training__seq_len=61,
    training__local_batch_size=2,
    training__warmup_steps=2,
    metrics__enable_tensorboard=False,
)


def losses(history):
    return {h["step"]: h["loss"] for h in history}


@pytest.fixture(scope="module")
def uninterrupted(pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return losses(pool.run("train_run", dp_shard=1, cp=2, job__dump_folder=str(out), **RUN)[0])


def test_kill_and_resume_is_bit_exact(pool, tmp_path, uninterrupted):
    ckpt = dict(
        checkpoint__enable=True, checkpoint__interval=3, job__dump_folder=str(tmp_path), **RUN
    )
    first = pool.run("train_run", dp_shard=1, cp=2, stop_after=4, **ckpt)[0]  # dies after step 4
    assert sorted(losses(first)) == [1, 2, 3, 4]
    assert latest_step_dir(tmp_path / "copy0" / "checkpoint").name == "step-3"
    second = losses(pool.run("train_run", dp_shard=1, cp=2, **ckpt)[0])  # same command again
    assert sorted(second) == [4, 5, 6]  # step 4 is redone from the step-3 checkpoint
    for step, loss in second.items():
        assert loss == uninterrupted[step], (step, loss, uninterrupted[step])
    lines = (tmp_path / "copy0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]  # step 4 once, redone


@pytest.mark.parametrize("copied", [True, False], ids=["copied", "control_uncopied"])
def test_async_checkpoint_resume_is_bit_exact(pool, tmp_path, uninterrupted, copied):
    """checkpoint.async_mode='async': step 2's save is written while steps 3 and 4 train (each
    write starts 1 s late), so the files hold step 2's state only if it was copied at step 2
    (the negative control writes the live tensors); the run dies after step 4, its own save
    written but not committed. The resume passes over step-4 and redoes steps 3-6 from step-2,
    equal to the uninterrupted synchronous run."""
    ckpt = dict(
        checkpoint__enable=True,
        checkpoint__interval=2,
        checkpoint__async_mode="async",
        job__dump_folder=str(tmp_path),
        **RUN,
    )
    first = pool.run(
        "train_run",
        dp_shard=1,
        cp=2,
        stop_after=4,
        slow_write_s=1.0,
        uncopied_async_state=not copied,
        **ckpt,
    )[0]
    assert sorted(losses(first)) == [1, 2, 3, 4]
    folder = tmp_path / "copy0" / "checkpoint"
    assert latest_step_dir(folder).name == "step-2"  # committed when step 4's save began
    assert (folder / "step-4" / ".metadata").is_file()  # written ...
    assert not (folder / "step-4" / "manifest.json").exists()  # ... never committed
    second = losses(pool.run("train_run", dp_shard=1, cp=2, **ckpt)[0])
    assert sorted(second) == [3, 4, 5, 6]
    if not copied:  # step-2 holds a later step's weights
        assert second[3] != pytest.approx(uninterrupted[3], rel=1e-3)
        return
    for step, loss in second.items():
        assert loss == uninterrupted[step], (step, loss, uninterrupted[step])
    assert latest_step_dir(folder).name == "step-6"  # the last save, finished before the end


def test_resume_at_another_cp_degree(pool, tmp_path, uninterrupted):
    ckpt = dict(
        checkpoint__enable=True, checkpoint__interval=3, job__dump_folder=str(tmp_path), **RUN
    )
    pool.run("train_run", dp_shard=1, cp=2, stop_after=3, **ckpt)
    resumed = losses(pool.run("train_run", dp_shard=1, cp=4, **ckpt)[0])  # 1 copy: reads copy0
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5)


def test_resume_from_tensor_parallel_at_another_layout(pool, tmp_path, uninterrupted):
    """Saved at cp=2 x tp=2 with sequence parallelism (2-D FSDP x TP shards), resumed at cp=2."""
    ckpt = dict(
        checkpoint__enable=True, checkpoint__interval=3, job__dump_folder=str(tmp_path), **RUN
    )
    first = losses(
        pool.run(
            "train_run",
            dp_shard=1,
            cp=2,
            tp=2,
            stop_after=3,
            parallelism__enable_sequence_parallel=True,
            **ckpt,
        )[0]
    )
    resumed = losses(
        pool.run("train_run", dp_shard=1, cp=2, **ckpt)[0]
    )  # copy0 reads the TP checkpoint
    assert sorted(first) == [1, 2, 3] and sorted(resumed) == [4, 5, 6]
    for step, loss in {**first, **resumed}.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5)


def test_a_crash_while_saving_leaves_the_previous_checkpoint(pool, tmp_path):
    ckpt = dict(
        checkpoint__enable=True, checkpoint__interval=2, job__dump_folder=str(tmp_path), **RUN
    )
    pool.run("train_run", dp_shard=1, cp=2, stop_after=2, **ckpt)
    folder = tmp_path / "copy0" / "checkpoint"
    (folder / "step-4").mkdir()  # a save that died before its trainer state was written
    (folder / "step-4" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_step_dir(folder).name == "step-2"
    resumed = losses(pool.run("train_run", dp_shard=1, cp=2, **ckpt)[0])
    assert sorted(resumed) == [3, 4, 5, 6]


def test_export_and_generate(pool, tmp_path):
    ckpt = dict(checkpoint__enable=True, job__dump_folder=str(tmp_path), **RUN)
    pool.run("train_run", dp_shard=1, cp=2, **ckpt)
    folder = tmp_path / "copy0" / "checkpoint"
    model, cfg = load_model_for_inference(folder)
    assert cfg.model.flavor == "debug"
    export_safetensors(folder, tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "model.safetensors"))
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    image = SyntheticCaptions(32, 16, 64, seed=99).sample(0)[0][0]  # [3, 32, 32]
    answer = generate(model, image, max_new_tokens=8)
    assert isinstance(answer, str) and len(answer) <= 8 * 4


def test_load_image_matches_the_training_range(tmp_path):
    from PIL import Image

    pixels = torch.zeros(40, 40, 3, dtype=torch.uint8)
    pixels[:, 20:] = 255
    Image.fromarray(pixels.numpy()).save(tmp_path / "half.png")
    image = load_image(str(tmp_path / "half.png"), 32)
    assert image.shape == (3, 32, 32) and image.min() == -1 and image.max() == 1


def test_resume_into_hsdp_with_the_same_global_batch(pool, tmp_path, uninterrupted):
    """cp=2 with 2 rows a rank, resumed as dp_replicate=2 x cp=2 with 1 row a rank: the same
    rows."""
    ckpt = dict(
        checkpoint__enable=True, checkpoint__interval=3, job__dump_folder=str(tmp_path), **RUN
    )
    pool.run("train_run", dp_shard=1, cp=2, stop_after=3, **ckpt)
    hsdp = {**ckpt, "training__local_batch_size": 1}
    resumed = losses(pool.run("train_run", dp_shard=1, cp=2, dp_replicate=2, **hsdp)[0])
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5)


def test_resume_into_another_vision_placement(pool, tmp_path, uninterrupted):
    """The optimizer state is keyed by parameter name, so the param groups (which follow the
    meshes, and so cp_vision) may differ between the saving and the resuming run."""
    ckpt = dict(
        checkpoint__enable=True, checkpoint__interval=3, job__dump_folder=str(tmp_path), **RUN
    )
    pool.run("train_run", dp_shard=1, cp=2, stop_after=3, parallelism__cp_vision="shard", **ckpt)
    resumed = losses(
        pool.run("train_run", dp_shard=1, cp=2, parallelism__cp_vision="broadcast", **ckpt)[0]
    )
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5)


def test_resuming_another_model_fails_in_one_line(pool, tmp_path):
    ckpt = dict(checkpoint__enable=True, job__dump_folder=str(tmp_path), **{**RUN, "steps": 1})
    pool.run("train_run", dp_shard=1, cp=2, **ckpt)
    with pytest.raises(
        RuntimeError, match=r"model.flavor='small', but the checkpoint .* holds a 'debug' model"
    ):
        pool.run("train_run", dp_shard=1, cp=2, model__flavor="small", **ckpt)
