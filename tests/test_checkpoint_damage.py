"""Checkpoints that can be trusted: every complete checkpoint records the size and SHA-256 of what
it wrote; resume verifies the newest and falls back to the newest one that verifies, with a
one-line warning; with none usable the run stops with one line. A non-finite loss never reaches
a checkpoint. Only the newest checkpoint.keep checkpoints are kept."""

import json
import math
import re
import shutil

import pytest
import torch
from cli import python_m

from titan_vlm.checkpoint import MANIFEST, load_model_for_inference, step_dirs, verify_step_dir

RUN = dict(
    steps=6,
    training__seq_len=61,
    training__local_batch_size=2,
    training__warmup_steps=2,
    metrics__enable_tensorboard=False,
    checkpoint__enable=True,
    checkpoint__interval=2,
)


def losses(history):
    return {h["step"]: h["loss"] for h in history}


@pytest.fixture(scope="module")
def whole(pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return losses(pool.run("train_run", dp_shard=1, cp=2, job__dump_folder=str(out), **RUN)[0])


@pytest.fixture(scope="module")
def stopped(pool, tmp_path_factory):
    """A run that died after step 4: complete checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("stopped")
    pool.run("train_run", dp_shard=1, cp=2, stop_after=4, job__dump_folder=str(out), **RUN)
    return out / "copy0"


def damaged_copy(stopped, tmp_path, damage):
    dump = tmp_path / "copy0"
    shutil.copytree(stopped, dump)
    damage(dump / "checkpoint")
    return tmp_path


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def overwrite_inside(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)  # same size; only the digest can tell
    path.write_bytes(bytes(data))


DAMAGE = {
    "missing shard": (
        lambda c: (c / "step-4" / "__1_0.distcp").unlink(),
        "__1_0.distcp is missing",
    ),
    "truncated shard": (lambda c: truncate(c / "step-4" / "__0_0.distcp"), "__0_0.distcp has"),
    "truncated facts.json": (lambda c: truncate(c / "step-4" / "facts.json"), "facts.json has"),
    "truncated .metadata": (lambda c: truncate(c / "step-4" / ".metadata"), ".metadata has"),
    "bytes overwritten in a shard": (
        lambda c: overwrite_inside(c / "step-4" / "__0_0.distcp"),
        "__0_0.distcp does not match its SHA-256",
    ),
    "garbage manifest": (
        lambda c: truncate(c / "step-4" / MANIFEST),
        "manifest.json is unreadable",
    ),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_each_kind_of_damage_fails_verification(stopped, tmp_path, kind):
    damage, why = DAMAGE[kind]
    dump = damaged_copy(stopped, tmp_path, damage)
    assert verify_step_dir(dump / "copy0" / "checkpoint" / "step-2") is None
    assert why in verify_step_dir(dump / "copy0" / "checkpoint" / "step-4")


# A resume per kind costs a run; these three cover a shard, a file rank 0 writes beside the DCP
# shards, and silent bytes.
@pytest.mark.parametrize(
    "kind", ["missing shard", "truncated facts.json", "bytes overwritten in a shard"]
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    pool, stopped, tmp_path, whole, kind
):
    damage, why = DAMAGE[kind]
    dump = damaged_copy(stopped, tmp_path, damage)
    out = pool.run("train_run_warnings", dp_shard=1, cp=2, job__dump_folder=str(dump), **RUN)[0]
    assert sorted(losses(out["history"])) == [3, 4, 5, 6]  # from step-2, the newest that verifies
    for step, loss in losses(out["history"]).items():
        assert loss == whole[step], step
    warned = [w for w in out["warnings"] if w.startswith("checkpoint:")]
    assert len(warned) == 1 and why in warned[0] and "resuming from" in warned[0], warned
    assert warned[0].endswith("step-2 instead") and "\n" not in warned[0]


def test_a_garbage_latest_is_passed_over_with_a_warning(pool, stopped, tmp_path, whole):
    dump = damaged_copy(stopped, tmp_path, lambda c: (c / "latest").write_bytes(b"\x00\xffgarb"))
    out = pool.run("train_run_warnings", dp_shard=1, cp=2, job__dump_folder=str(dump), **RUN)[0]
    assert sorted(losses(out["history"])) == [5, 6]  # step-4 itself verifies
    assert all(losses(out["history"])[s] == whole[s] for s in (5, 6))
    warned = [w for w in out["warnings"] if w.startswith("checkpoint:")]
    assert len(warned) == 1 and "not a step" in warned[0], warned


def test_inference_and_export_verify_the_checkpoint_in_one_line(stopped, tmp_path):
    """generate --checkpoint and --export-hf verify the manifest as a resume does: a truncated
    shard is one line naming it, not torch.load's EOFError traceback (no fallback to step-2:
    the newest was asked for)."""
    from PIL import Image

    dump = damaged_copy(stopped, tmp_path, DAMAGE["truncated shard"][0])
    step_dir = dump / "copy0" / "checkpoint" / "step-4"
    Image.new("RGB", (32, 32), (255, 0, 0)).save(tmp_path / "red.png")
    for module, *argv in (
        ("titan_vlm.generate", "--checkpoint", str(step_dir.parent), "--image", "red.png"),
        ("titan_vlm.checkpoint", "--export-hf", str(step_dir.parent), str(tmp_path / "hf")),
        ("titan_vlm.checkpoint", "--export", str(step_dir), str(tmp_path / "m.safetensors")),
    ):
        argv = [str(tmp_path / a) if a == "red.png" else a for a in argv]
        done = python_m(module, *argv)
        assert done.returncode == 1 and done.stdout == "", (module, done.stderr[-3000:])
        assert done.stderr.splitlines() == [
            f"error: checkpoint {step_dir} is unusable: __0_0.distcp has "
            f"{(step_dir / '__0_0.distcp').stat().st_size} bytes, the manifest says "
            f"{json.loads((step_dir / MANIFEST).read_text())['files']['__0_0.distcp']['size']}"
        ], (module, done.stderr[-3000:])
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.safetensors").exists()


def test_no_usable_checkpoint_is_one_line(pool, stopped, tmp_path):
    def damage(folder):
        truncate(folder / "step-4" / "__0_0.distcp")
        (folder / "step-2" / "facts.json").unlink()

    dump = damaged_copy(stopped, tmp_path, damage)
    with pytest.raises(RuntimeError) as e:
        pool.run("train_run", dp_shard=1, cp=2, job__dump_folder=str(dump), **RUN)
    line = next(x for x in str(e.value).splitlines() if "CheckpointError: " in x)
    assert "no usable checkpoint in" in line and "step-4 is unusable: __0_0.distcp has" in line
    assert "step-2 is unusable: facts.json is missing" in line and "move the folder away" in line


def test_each_checkpoint_records_sizes_and_digests_and_only_keep_are_kept(pool, tmp_path):
    run = {**RUN, "steps": 10, "checkpoint__keep": 2}
    pool.run("train_run", dp_shard=1, cp=2, job__dump_folder=str(tmp_path), **run)
    folder = tmp_path / "copy0" / "checkpoint"
    assert [n for n, _ in step_dirs(folder)] == [10, 8]
    manifest = json.loads((folder / "step-10" / MANIFEST).read_text())["files"]
    on_disk = {p.name for p in (folder / "step-10").iterdir()} - {MANIFEST}
    assert manifest.keys() == on_disk >= {".metadata", "facts.json", "config.json", "__1_0.distcp"}
    assert all(manifest[n]["size"] == (folder / "step-10" / n).stat().st_size for n in on_disk)
    assert verify_step_dir(folder / "step-10") is None


def all_finite(step_dir) -> bool:
    model, _ = load_model_for_inference(step_dir)
    return all(bool(torch.isfinite(v).all()) for v in model.state_dict().values())


def test_nan_stops_the_run_before_it_reaches_a_checkpoint(pool, tmp_path):
    with pytest.raises(RuntimeError) as e:
        pool.run(
            "train_run_with_nan_images",
            dp_shard=1,
            cp=2,
            nan_step=5,
            job__dump_folder=str(tmp_path),
            **RUN,
        )
    assert "NonFiniteError: step 5: loss nan, grad_norm nan: not finite" in str(e.value)
    folder = tmp_path / "copy0" / "checkpoint"
    assert (folder / "latest").read_text().strip() == "4" and [n for n, _ in step_dirs(folder)] == [
        4,
        2,
    ]
    assert all_finite(folder / "step-4")


def test_nan_step_is_skipped_and_counted(pool, tmp_path, whole):
    out = pool.run(
        "train_run_with_nan_images",
        dp_shard=1,
        cp=2,
        nan_step=3,
        job__dump_folder=str(tmp_path),
        training__on_nonfinite="skip",
        **RUN,
    )[0]
    history = {h["step"]: h for h in out["history"]}
    assert math.isnan(history[3]["loss"]) and history[3]["nonfinite_skipped"] == 1
    assert [history[s]["nonfinite_skipped"] for s in (1, 2, 4, 6)] == [0, 0, 1, 1]
    assert history[2]["loss"] == whole[2] and history[4]["loss"] != whole[4]  # step 3 did nothing
    assert all(math.isfinite(history[s]["loss"]) for s in (4, 5, 6))
    assert any("step 3: loss nan" in w and "skipped" in w for w in out["warnings"])
    assert all_finite(tmp_path / "copy0" / "checkpoint" / "step-6")


def test_a_checkpoint_the_disk_cannot_take_is_one_line_and_latest_stays(pool, tmp_path):
    """Shards larger than a file may grow (as on a full disk): before, torch's "unexpected pos"
    error on some ranks; now the same one line on every rank, naming the file."""
    run = dict(RUN, checkpoint__interval=4)
    pool.run("train_run", dp_shard=1, cp=2, stop_after=4, job__dump_folder=str(tmp_path), **run)
    shard = tmp_path / "copy0" / "checkpoint" / "step-4" / "__0_0.distcp"
    with pytest.raises(RuntimeError) as e:
        pool.run(
            "train_run_with_file_size_limit",
            dp_shard=1,
            cp=2,
            limit_bytes=shard.stat().st_size // 2,
            job__dump_folder=str(tmp_path),
            **{**run, "steps": 8},
        )
    lines = [x for x in str(e.value).splitlines() if "UserError: " in x]
    assert len(lines) == 2, str(e.value)[-4000:]  # two ranks reported: the same line on each
    assert lines[0] == lines[1] and "UserError: checkpoint: cannot write " in lines[0]
    # the file that hits the limit first is a DCP shard (torch's writer) or a plain write (the
    # OS's EFBIG), depending on how the model's tensors fall into the files
    assert re.search(
        r"step-8 \(rank 0\): (RuntimeError: \[enforce fail at inline_container\.cc|File too large)",
        lines[0],
    ), lines[0]
    assert (
        "bytes free there: a full disk, a quota?); the latest checkpoint is still step-4"
        in (lines[0])
    )
    assert (tmp_path / "copy0" / "checkpoint" / "latest").read_text().strip() == "4"


def test_a_checkpoint_without_a_key_this_version_keeps_is_one_line(pool, stopped, tmp_path):
    """A checkpoint written before the trainer kept a key (an older titan_vlm: before the data's
    position was kept): one line naming the key and what to do, not DCP's error in the load."""
    dump = damaged_copy(stopped, tmp_path, lambda c: None)
    with pytest.raises(RuntimeError) as e:
        pool.run("train_run_keeping_a_new_key", dp_shard=1, cp=2, job__dump_folder=str(dump), **RUN)
    line = next(x for x in str(e.value).splitlines() if "ConfigError: " in x)
    assert line.endswith(
        "step-4: the checkpoint lacks trainer.a_new_key (written by an older titan_vlm, which "
        "read the data otherwise): start a new checkpoint.folder, with "
        "checkpoint.initial_load_path at it for its weights"
    )
