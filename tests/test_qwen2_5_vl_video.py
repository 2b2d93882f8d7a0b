"""Video FILES on a Qwen2.5-VL folder whose video processor samples frames
(video_preprocessor_config.json: do_sample_frames, fps, min_frames, max_frames), against
transformers 5, offline:

- a JSONL record's "video": "clip.mp4" becomes the sample transformers makes of that file: the
  frames Qwen2VLVideoProcessor.sample_frames keeps (compiled from its source), decoded as
  transformers' PyAV reader decodes them, processed and expanded to their <|video_pad|> tokens as
  Qwen2_5_VLProcessor does, and M-RoPE positions equal get_rope_index's with the
  second_per_grid_ts of the frames' sampled rate (the control: the default rate moves them);
- a truncated or missing video file is a bad sample, skipped and counted;
- `python -m titan_vlm.generate --video clip.mp4` answers as transformers' greedy generate;
- ./run_train.sh trains on the file at CP=2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_qwen2_5_vl_jsonl import MAX_PIXELS, MIN_PIXELS, TEMPLATE, write_folder
from test_qwen2_5_vl_processor import StandInVideoProcessor, hf_frames, hf_processor

from titan_vlm.data.batch import VideoFrames
from titan_vlm.data.jsonl import JsonlDataset
from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl.images import MROPE_POSITIONS, folder_rule
from titan_vlm.models.common.qwen_vl.processor import FrameSampling, chat_processor, patchify_frames
from titan_vlm.models.qwen2_5_vl.hf_config import args_from_hf_config

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")
from test_video import transformers_sample_frames, write_mp4  # noqa: E402
from transformers.video_utils import VideoMetadata, read_video_pyav  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# 16 frames at 8 fps (2 s) sampled at 2 fps within [2, 6] frames: 4 kept (0, 4, 8, 12), at 2
# frames per second: 2 temporal patches 1 s apart, 2 positions at tokens_per_second 2. (Short:
# text after a video whose temporal span exceeds its spatial one resumes elsewhere in
# transformers >= 5.3 than Qwen's rule says, models/common/qwen_vl/mrope.py.)
SAMPLING = {"do_sample_frames": True, "fps": 2.0, "min_frames": 2, "max_frames": 6}
FRAMES, RATE = 16, 8
QUESTION, ANSWER = "What happens?", "The dot moves."
RECORDS = [
    {
        "video": "clip.mp4",
        "conversations": [
            {"from": "human", "value": f"<video>\n{QUESTION}"},
            {"from": "gpt", "value": ANSWER},
        ],
    },
    {  # bad: a truncated file, a missing one
        "video": "cut.mp4",
        "conversations": [{"from": "human", "value": "<video>?"}, {"from": "gpt", "value": "a"}],
    },
    {
        "video": "missing.mp4",
        "conversations": [{"from": "human", "value": "<video>?"}, {"from": "gpt", "value": "b"}],
    },
]
MESSAGES = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]},
    {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
]


class FileVideoProcessor(StandInVideoProcessor):
    """The stand-in video processor with the metadata of frames sampled from a file, so that
    Qwen2_5_VLProcessor computes second_per_grid_ts from their sampled rate."""

    def __init__(self, hf, metadata):
        super().__init__(hf)
        self.metadata = metadata

    def __call__(self, videos, **kwargs):
        out = super().__call__(videos, **kwargs)
        out["video_metadata"] = [self.metadata]
        return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The folder (the jsonl tests' tokenizer, template and image processor, plus video settings
    that sample frames), the JSONL file, and transformers' view of clip.mp4."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("qwen_video")
    folder = root / "qwen"
    hf = write_folder(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    video_settings = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        **SAMPLING,
    }
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video_settings))
    tok_eos = tok.token_to_id("<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": tok_eos}))

    data = root / "data"
    data.mkdir()
    clip = write_mp4(data / "clip.mp4", FRAMES, fps=RATE)
    (data / "cut.mp4").write_bytes(clip.read_bytes()[:900])
    path = data / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))

    # transformers' view of the file: its sampled frame indices, its reader's frames, metadata
    sampling = FrameSampling(True, SAMPLING["fps"], None, 2, 6, 2)
    frames, meta = read_video_pyav(
        str(clip),
        sample_indices_fn=lambda metadata, **_: np.array(
            transformers_sample_frames(sampling, metadata.total_num_frames, metadata.fps)
        ),
    )
    meta = VideoMetadata(
        total_num_frames=meta.total_num_frames, fps=meta.fps, frames_indices=meta.frames_indices
    )
    return folder, hf, path, [Image.fromarray(f) for f in frames], meta


def reference(hf, folder: Path, frames, meta, text: str):
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    proc = hf_processor(hf, tok)
    proc.video_processor = FileVideoProcessor(hf, meta)
    return proc(text=[text], videos=[frames], return_tensors="pt")


def dataset(folder: Path, path: Path):
    """The JSONL file read through the folder's processor and data rule, and that rule."""
    args = args_from_hf_config(json.loads((folder / "config.json").read_text()), "config.json")
    rule = folder_rule(args, str(folder))
    proc = chat_processor(folder)
    data = JsonlDataset(
        str(path), proc.tokenizer, args.image_size, args.tokens_per_image, 512, 0,
        shuffle=False, processor=proc, rule=rule, slot_data=rule.positions,
    )  # fmt: skip
    return data, rule


def test_video_file_sample_equals_transformers(setup):
    folder, hf, path, frames, meta = setup
    assert len(frames) == 4 and meta.sampled_fps == 4 / FRAMES * RATE == 2.0
    data, rule = dataset(folder, path)
    assert sum(data.skipped.values()) == 2, data.skipped
    assert set(data.skipped) == {"video cannot be decoded", "missing image file"}
    ((sample,),) = data.read(data.plan(range(1)))
    (video,) = [p for p in sample.parts if isinstance(p, VideoFrames)]
    assert video.fps == meta.sampled_fps and video.frames.shape[0] == len(frames)

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    template = hf_processor(hf, tok)
    template.chat_template = TEMPLATE
    text = template.apply_chat_template(MESSAGES, tokenize=False)
    want = reference(hf, folder, frames, meta, text)
    expected, grid = hf_frames(frames, hf, MIN_PIXELS, MAX_PIXELS)
    assert torch.equal(want["pixel_values_videos"], expected)
    patches, ours_grid = patchify_frames(video.frames, 14, 2, 2)
    assert torch.equal(patches, want["pixel_values_videos"])
    assert [list(ours_grid)] == want["video_grid_thw"].tolist() == grid.tolist()
    assert want["second_per_grid_ts"].tolist() == pytest.approx([2 / meta.sampled_fps])

    batch = data.batch(0, 0, 1, 1)
    n = sample.num_slots(data.slots)
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    # the video's slots hold the batch's image id (the decoder reads its embeddings there)
    tokens = batch.tokens[0, :n].masked_fill(batch.image[0, :n] >= 0, video_id)
    assert tokens.tolist() == want["input_ids"][0].tolist()
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    ids = want["input_ids"]
    types = 2 * (ids == video_id).long()
    theirs, _ = hf_model.model.get_rope_index(
        ids, types, None, want["video_grid_thw"], want["second_per_grid_ts"]
    )
    ours = batch.slot_data[MROPE_POSITIONS][:, 0, :n]
    assert torch.equal(ours, theirs[:, 0])
    # the control: the frames' default rate (frame files carry none) puts them elsewhere
    as_frames = rule.positions(
        type(sample)([video.frames if p is video else p for p in sample.parts])
    )
    assert not torch.equal(as_frames[MROPE_POSITIONS], ours)


def test_without_pyav_a_video_file_stops_the_run_in_one_line(setup, monkeypatch):
    """A missing package is the job's problem, not the record's: start-up stops with one line
    naming the file and the install, instead of skipping every video record."""
    folder, _, path, _, _ = setup
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    with pytest.raises(ConfigError) as e:
        dataset(folder, path)
    assert "clip.mp4" in str(e.value) and "pip install 'titan_vlm[video]'" in str(e.value)
    assert "\n" not in str(e.value)


def test_generate_about_a_video_file_equals_transformers_greedy(setup, capsys):
    """titan_vlm.generate's command line, its main in this process (tests/
    test_checkpoint_damage.py runs it as a subprocess)."""
    from titan_vlm.generate import main as generate_main

    folder, hf, path, frames, meta = setup
    argv = ["--hf-path", str(folder), "--video", str(path.parent / "clip.mp4")]
    argv += ["--prompt", QUESTION, "--max-new-tokens", "6", "--print-ids"]
    generate_main(argv)
    ours = [int(i) for i in capsys.readouterr().out.strip().splitlines()[-1].split()]

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    template = hf_processor(hf, tok)
    template.chat_template = TEMPLATE
    text = template.apply_chat_template(MESSAGES[:1], tokenize=False, add_generation_prompt=True)
    inputs = reference(hf, folder, frames, meta, text)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=eos)
    theirs = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(ours) > 1 and ours == theirs, (ours, theirs)

    with pytest.raises(SystemExit) as stop:
        generate_main(["--hf-path", str(folder), "--video", str(path.parent / "cut.mp4"),
                       "--prompt", "?"])  # fmt: skip
    err = str(stop.value.code)  # sys.exit's message: the interpreter prints it, exit status 1
    assert err.count("\n") == 0, err
    assert err.startswith("error: --video: ") and "cut.mp4: cannot be opened" in err


def test_run_train_cp2_on_a_video_file(setup, tmp_path):
    folder, _, path, _, _ = setup
    out = subprocess.run(
        [
            "./run_train.sh", "--config", "train_configs/vlm_cp.toml", "--model.flavor=hf",
            f"--model.hf_path={folder}", f"--data.dataset={path}", "--training.steps=2",
            "--training.local_batch_size=1", "--checkpoint.enable=false",
            "--metrics.enable_tensorboard=false", f"--job.dump_folder={tmp_path / 'run'}",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["data_bad_samples"] == 2 for s in steps)
    assert "1 video(s)" in out.stdout + out.stderr
