"""Resume checks the config it resumes into: what must match the checkpoint (the model's shape,
seq_len, the global batch, the data and its file, the seed) stops the run with one line naming
the keys, unless --checkpoint.allow_config_change; what may change (the parallel layout, steps,
the lr schedule) is accepted and logged."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
from hf_folders import save_llava_folder

from titan_vlm.checkpoint import load_model_for_inference
from titan_vlm.config import ConfigError, load_config
from titan_vlm.resume_config import DATA_FILE, GLOBAL_ROWS, check_resume_config, run_facts

RUN = dict(
    steps=6,
    training__seq_len=61,
    training__local_batch_size=2,
    training__warmup_steps=2,
    metrics__enable_tensorboard=False,
    checkpoint__enable=True,
    checkpoint__interval=2,
)


def check(saved_args, args, saved_rows=8, rows=8):
    saved = load_config(saved_args)
    cfg = load_config(args)
    return check_resume_config(
        dataclasses.asdict(saved),
        {GLOBAL_ROWS: saved_rows, DATA_FILE: None},
        cfg,
        {GLOBAL_ROWS: rows, DATA_FILE: None},
        "ckpt/step-6",
    )


def test_what_may_change_is_accepted_and_logged():
    warning, note = check(
        ["--training.steps=10"],
        ["--training.steps=20", "--parallelism.context_parallel_degree=4"],
    )
    assert warning is None
    assert note == (
        "resume from ckpt/step-6: training.steps 10 -> 20, "
        "parallelism.context_parallel_degree 1 -> 4"
    )
    assert check([], []) == (None, None)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--training.seed=1"], "training.seed 0 -> 1"),
        (["--training.seq_len=128"], "training.seq_len 256 -> 128"),
        (["--data.dataset=other.jsonl"], "data.dataset 'synthetic' -> 'other.jsonl'"),
        (["--data.packing"], "data.packing False -> True"),
        (["--model.flavor=small"], "model.flavor 'debug' -> 'small'"),
        (["--model.name=qwen2_5_vl"], "model.name 'llava' -> 'qwen2_5_vl'"),
        (["--data.native_resolution_pixels=4096"], "data.native_resolution_pixels 0 -> 4096"),
        (["--data.max_image_pixels=100"], "data.max_image_pixels 16777216 -> 100"),
        (["--data.index_window=1024"], "data.index_window 16384 -> 1024"),
    ],
)
def test_what_must_match_is_one_line_naming_the_key(args, named):
    with pytest.raises(ConfigError) as e:
        check([], args)
    assert str(e.value) == (
        f"resume from ckpt/step-6: {named} changed, and must match the checkpoint (the model, the "
        "data and the data position follow them); restore them (a run naming the source paths it "
        "trained from reads the checkpoint's copies of them), use another checkpoint.folder, or "
        "pass --checkpoint.allow_config_change"
    )


def test_the_global_batch_and_the_dataset_file_must_match(tmp_path):
    with pytest.raises(ConfigError, match=r"global batch rows \(dp x .*\) 8 -> 4 changed"):
        check([], [], saved_rows=8, rows=4)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    cfg = load_config([f"--data.dataset={data}"])
    before = run_facts(cfg, 8)
    data.write_text('{"text": "b"}\n')  # same size, other bytes
    after = run_facts(cfg, 8)
    assert before[DATA_FILE] != after[DATA_FILE]
    asdict = dataclasses.asdict(cfg)
    with pytest.raises(ConfigError, match=r"data.dataset's contents \(size, SHA-256\) '14 bytes"):
        check_resume_config(asdict, before, cfg, after, "ckpt/step-6")


def test_allow_config_change_turns_the_error_into_a_warning():
    warning, note = check([], ["--training.seed=1", "--checkpoint.allow_config_change"])
    assert warning == (
        "resume from ckpt/step-6: training.seed 0 -> 1 changed (checkpoint.allow_config_change)"
    )
    assert note == "resume from ckpt/step-6: checkpoint.allow_config_change False -> True"


def test_a_real_resume_with_another_seed_stops_and_allow_config_change_goes_on(pool, tmp_path):
    pool.run("train_run", dp_shard=1, cp=2, stop_after=2, job__dump_folder=str(tmp_path), **RUN)
    with pytest.raises(RuntimeError, match=r"ConfigError: resume from .*step-2: training.seed"):
        pool.run(
            "train_run", dp_shard=1, cp=2, job__dump_folder=str(tmp_path), training__seed=3, **RUN
        )
    with pytest.raises(RuntimeError, match=r"global batch rows .* 2 -> 4 changed"):
        pool.run(
            "train_run", dp_shard=2, cp=2, job__dump_folder=str(tmp_path), **RUN
        )  # dp 1 -> 2 with the same local batch: twice the rows per step
    out = pool.run(
        "train_run_warnings",
        dp_shard=1,
        cp=2,
        job__dump_folder=str(tmp_path),
        training__seed=3,
        checkpoint__allow_config_change=True,
        **RUN,
    )[0]
    assert [h["step"] for h in out["history"]] == [3, 4, 5, 6]
    assert any(
        "training.seed 0 -> 3 changed (checkpoint.allow_config_change)" in w
        for w in out["warnings"]
    )
    saved = json.loads((tmp_path / "copy0" / "checkpoint" / "step-6" / "config.json").read_text())
    assert saved["training"]["seed"] == 3


def test_a_checkpoint_is_independent_of_its_source_folder(pool, tmp_path):
    """A checkpoint carries copies of what decides the model's numbers besides the weights
    (config.json, tokenizer, chat template, processor settings; the source tensors' names,
    dtypes and shapes, and the unused ones), and a fingerprint of the source's files. Edited
    after training (another rope_theta: other numbers from the same weights; a new file; a lost
    tokenizer.json) or gone, the source changes nothing: a resume reads the copies (a warning
    names what changed) and continues the uninterrupted run; generate and the exports give what
    they gave before. The control: the edited folder read as a source (another path, with
    checkpoint.allow_config_change) trains other numbers; without it, one line refuses it."""
    from transformers import LlavaForConditionalGeneration

    from titan_vlm.models.hf_export import export_hf

    folder = save_llava_folder(tmp_path / "llava", "clip_llama3")
    run = dict(RUN, model__flavor="hf", model__hf_path=str(folder), steps=4)
    whole = pool.run("train_run", dp_shard=1, cp=1, job__dump_folder=str(tmp_path / "whole"), **run)
    losses = {h["step"]: h["loss"] for h in whole[0]}
    pool.run(
        "train_run", dp_shard=1, cp=1, stop_after=2, job__dump_folder=str(tmp_path / "a"), **run
    )

    def resume(name: str, function: str = "train_run", **changes):
        """Resume a copy of the run stopped after step 2, in tmp_path/name."""
        shutil.copytree(tmp_path / "a", tmp_path / name)
        job = dict(run, job__dump_folder=str(tmp_path / name), **changes)
        return pool.run(function, dp_shard=1, cp=1, **job)[0]

    checkpoint = tmp_path / "a" / "copy0" / "checkpoint"
    model, cfg = load_model_for_inference(checkpoint)
    from_source = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, hf_path=str(folder))
    )
    export_hf(model, from_source, tmp_path / "export_before")  # from the source folder itself
    config = (folder / "config.json").read_text()
    edited = json.loads(config)
    edited["text_config"]["rope_parameters"]["rope_theta"] = 10.0
    (folder / "config.json").write_text(json.dumps(edited))

    # the control: the edited folder as a source (another path) trains other numbers
    shutil.copytree(folder, tmp_path / "llava_edited")
    changed = r"the source files model.hf_path: config.json changed \(\d+ bytes, \w+ -> "
    with pytest.raises(RuntimeError, match=rf"ConfigError: resume from .*step-2: {changed}"):
        resume("refused", model__hf_path=str(tmp_path / "llava_edited"))
    other = resume(
        "other",
        model__hf_path=str(tmp_path / "llava_edited"),
        checkpoint__allow_config_change=True,
    )
    assert other[0]["step"] == 3 and other[0]["loss"] != losses[3]

    tokenizer = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").unlink()
    (folder / "notes.txt").write_text("a file that was not there")
    out = resume("edited", "train_run_warnings")
    assert {h["step"]: h["loss"] for h in out["history"]} == {3: losses[3], 4: losses[4]}
    assert any(
        re.search(
            r"config.json changed .*, model.hf_path: notes.txt added, model.hf_path: "
            r"tokenizer.json removed since the checkpoint was written; this run reads the "
            r"checkpoint's copies \(.*step-2/source\), as it trained",
            w,
        )
        for w in out["warnings"]
    ), out["warnings"]

    folder.rename(tmp_path / "moved")  # the source gone: resume, generate, export read the copies
    gone = resume("gone", "train_run_warnings")
    assert {h["step"]: h["loss"] for h in gone["history"]} == {3: losses[3], 4: losses[4]}
    assert any(
        re.search(rf"model.hf_path {folder} is gone; this run reads the checkpoint's copies", w)
        for w in gone["warnings"]
    ), gone["warnings"]
    model, cfg = load_model_for_inference(checkpoint)
    assert Path(cfg.model.hf_path) == checkpoint / "step-2" / "source" / "model.hf_path"
    assert (
        model.args.decoder.rope_theta
        == json.loads(config)["text_config"]["rope_parameters"]["rope_theta"]
    )
    export_hf(model, cfg, tmp_path / "export_after")
    before = {f.name: f.read_bytes() for f in (tmp_path / "export_before").iterdir()}
    after = {f.name: f.read_bytes() for f in (tmp_path / "export_after").iterdir()}
    assert after == before  # the same files, byte for byte, tokenizer.json among them
    assert after["tokenizer.json"] == tokenizer
    _, info = LlavaForConditionalGeneration.from_pretrained(
        tmp_path / "export_after", output_loading_info=True
    )
    assert not any(info.values()), info
