"""Qwen3-VL videos against transformers 5, offline, on a folder transformers writes (a tiny
Qwen3VLForConditionalGeneration; the Qwen2.5-VL jsonl tests' byte-level tokenizer and chat
template; Qwen2VLImageProcessorPil with 16-pixel patches; Qwen3VLVideoProcessor's own
video_preprocessor_config.json, sampling at 2 frames per second):

- a JSONL conversation about an mp4 file, and one about five frame files, become the samples
  Qwen3VLProcessor makes: the frames Qwen3VLVideoProcessor.sample_frames keeps (its own method;
  of frame files, as its _decode_and_sample_videos samples frames given without metadata, at
  24 frames a second: 4 of the 5),
  at the size its smart_resize gives the frames' size and count, each frame group's
  "<t seconds>" and its own vision start / end tokens in the ids (the chat template's wrapper
  collapsed), the patches, and M-RoPE positions equal to get_rope_index's;
- the model's logits on that row equal transformers' forward with pixel_values_videos;
- generate about the file: greedy ids equal transformers' generate;
- controls: Qwen2.5-VL's processor on the same record writes other ids (one wrapper, no
  timestamps); a caption holding a video is a bad sample, in one line.

Pixels: transformers' video processor resizes with torchvision, which is not installed here, so
the reference frames go through the PIL image processor's own steps at the video size (as the
Qwen2.5-VL video tests do); the layout is Qwen3VLVideoProcessor.patchify's.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_folders import save_qwen3
from PIL import Image
from test_qwen2_5_vl_jsonl import SPECIALS, TEMPLATE, write_tokenizer

from titan_vlm.config import JobConfig
from titan_vlm.data.batch import VideoFrames
from titan_vlm.data.jsonl import JsonlDataset
from titan_vlm.models.common.qwen_vl.images import MROPE_POSITIONS, folder_rule
from titan_vlm.models.common.qwen_vl.processor import chat_processor, patchify_frames
from titan_vlm.models.qwen3_vl.hf_config import args_from_hf_config
from titan_vlm.models.qwen3_vl.images import Qwen3Rule
from titan_vlm.models.qwen3_vl.model import from_hf_folder
from titan_vlm.models.qwen3_vl.video import QWEN3_VIDEO, qwen3_chat_processor

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")
from test_video import write_mp4  # noqa: E402
from transformers.image_utils import SizeDict  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (  # noqa: E402
    Qwen3VLVideoProcessor,
    smart_resize,
)
from transformers.video_utils import VideoMetadata, read_video_pyav  # noqa: E402

TOL = 1e-5
# 20 frames at 8 fps sampled at 2 fps: int(20 / 8 * 2) = 5 frames kept (0, 5, 10, 14, 19), three
# frame groups (the last padded), at 0.3, 1.5 and 2.4 seconds
FRAMES, RATE = 20, 8
VIDEO_SIZE = {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 20}
QUESTION, ANSWER = "What happens?", "The dot moves."
CONVERSATION = [
    {"from": "human", "value": f"<video>\n{QUESTION}"},
    {"from": "gpt", "value": ANSWER},
]
RECORDS = [
    {"video": "clip.mp4", "conversations": CONVERSATION},
    {"video": [f"f{i}.png" for i in range(5)], "conversations": CONVERSATION},
    {"video": "clip.mp4", "text": "A caption <video> of a dot."},  # bad: a caption
]
MESSAGES = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]},
    {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
]


class StandInVideoProcessor:
    """What Qwen3VLProcessor asks of its video processor: transformers' Qwen3VLVideoProcessor
    sizes (its smart_resize of the frames' size and count) and lays out (its patchify) the
    frames; each frame is resized, rescaled and normalized by the PIL image processor's steps
    (module docstring). `metadata`: the video's, as transformers' reader returns it (its frames
    were sampled from the file); None: frames given without metadata, which transformers'
    _decode_and_sample_videos samples (its own code)."""

    def __init__(self, image: Qwen2VLImageProcessorPil, video: Qwen3VLVideoProcessor):
        self.image, self.hf = image, video
        self.merge_size, self.temporal_patch_size = video.merge_size, video.temporal_patch_size
        self.metadata: VideoMetadata | None = None

    def __call__(self, videos, **kwargs):
        (frames,) = videos
        v, factor = self.hf, self.hf.patch_size * self.hf.merge_size
        metadata = self.metadata
        if metadata is None:  # frame files: transformers samples them (fps assumed 24)
            sample = partial(v.sample_frames, fps=v.fps, num_frames=v.num_frames)
            (kept,), (metadata,) = v._decode_and_sample_videos(
                [frames], video_metadata=None, do_sample_frames=True, sample_indices_fn=sample
            )
            frames = [Image.fromarray(f) for f in kept]
        height, width = frames[0].height, frames[0].width
        size = smart_resize(len(frames), height, width, v.temporal_patch_size, factor,
                            v.size.shortest_edge, v.size.longest_edge)  # fmt: skip
        processed = []
        for frame in frames:
            x = self.image.process_image(frame, do_convert_rgb=True)
            x = super(Qwen2VLImageProcessorPil, self.image).resize(
                x, size=SizeDict(height=size[0], width=size[1]), resample=v.resample
            )
            x = self.image.rescale(x, v.rescale_factor)
            x = self.image.normalize(x, v.image_mean, v.image_std)
            processed.append(torch.from_numpy(np.ascontiguousarray(x)))
        patches, t, h, w = v.patchify(
            torch.stack(processed)[None], v.patch_size, v.merge_size, v.temporal_patch_size
        )
        return {
            "pixel_values_videos": patches[0],
            "video_grid_thw": torch.tensor([[t, h, w]]),
            "video_metadata": [metadata],
        }


def hf_processor(folder: Path, image, video) -> Qwen3VLProcessor:
    """transformers' Qwen3VLProcessor with the stand-in video processor (its constructor checks
    the video processor's class)."""

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    proc = Processor(
        image_processor=image, tokenizer=tok, video_processor=StandInVideoProcessor(image, video)
    )
    proc.chat_template = TEMPLATE
    return proc


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The folder, the data (an mp4, three frame files, the JSONL file), transformers' processor
    and model, and transformers' view of clip.mp4 (its sampled frames and metadata)."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("qwen3_video")
    folder = root / "qwen3"
    folder.mkdir()
    write_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    vocab = (tok.get_vocab_size() + 15) // 16 * 16
    names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    hf_model = save_qwen3(folder, vocab=vocab, ids=tuple(ids[n] for n in names))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    mean = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    image = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32 * 2,
                                     max_pixels=32 * 32 * 12, **mean)  # fmt: skip
    image.save_pretrained(folder)
    video = Qwen3VLVideoProcessor(size=VIDEO_SIZE)
    video.save_pretrained(folder)
    eos = tok.token_to_id("<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))

    data = root / "data"
    data.mkdir()
    clip = write_mp4(data / "clip.mp4", FRAMES, fps=RATE)
    rng = np.random.default_rng(1)
    for i in range(5):
        pixels = rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(data / f"f{i}.png")
    path = data / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))

    frames, meta = read_video_pyav(
        str(clip),
        sample_indices_fn=lambda metadata, **_: video.sample_frames(
            metadata, fps=video.fps, num_frames=video.num_frames
        ),
    )
    meta = VideoMetadata(
        total_num_frames=meta.total_num_frames, fps=meta.fps, frames_indices=meta.frames_indices
    )
    proc = hf_processor(folder, image, video)
    return folder, path, hf_model, proc, [Image.fromarray(f) for f in frames], meta


def reference(proc, frames, meta, text: str):
    proc.video_processor.metadata = meta
    return proc(text=[text], videos=[frames], return_tensors="pt")


def dataset(folder: Path, path: Path, chat=qwen3_chat_processor) -> JsonlDataset:
    config = json.loads((folder / "config.json").read_text())
    args = args_from_hf_config(config, "config.json")
    rule = folder_rule(args, str(folder), Qwen3Rule, QWEN3_VIDEO)
    proc = chat(folder)
    return JsonlDataset(
        str(path), proc.tokenizer, args.image_size, args.tokens_per_image, 512, 0,
        shuffle=False, processor=proc, rule=rule, slot_data=rule.positions,
    )  # fmt: skip


def test_video_samples_equal_transformers(setup):
    folder, path, hf_model, proc, frames, meta = setup
    assert list(meta.frames_indices) == [0, 5, 10, 14, 19]
    data = dataset(folder, path)
    assert sum(data.skipped.values()) == 1 and set(data.skipped) == {"bad record"}, data.skipped
    assert "2 samples with 0 image(s) and 2 video(s)" in data.describe()
    text = proc.apply_chat_template(MESSAGES, tokenize=False)
    frame_files = [Image.open(path.parent / f"f{i}.png") for i in range(5)]
    ours_model = from_hf_folder(folder).eval()
    video_id = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    image_id = ours_model.args.image_token_id
    for row, (video, video_meta) in enumerate([(frames, meta), (frame_files, None)]):
        want = reference(proc, video, video_meta, text)
        ((sample,),) = data.read(data.plan(range(row, row + 1)))
        groups = [p for p in sample.parts if isinstance(p, (VideoFrames, torch.Tensor))]
        assert len(groups) == want["video_grid_thw"][0, 0] == (3 if row == 0 else 2)
        assert [p.frames.shape[0] for p in groups] == ([2, 2, 1] if row == 0 else [2, 2])
        pixels = [g.frames if isinstance(g, VideoFrames) else g for g in groups]
        patches = torch.cat([patchify_frames(p, 16, 2, 2)[0] for p in pixels])
        assert torch.equal(patches, want["pixel_values_videos"])

        batch = data.batch(row, 0, 1, 1)
        n = sample.num_slots(data.slots)
        ids = want["input_ids"]
        tokens = batch.tokens[0, :n].masked_fill(batch.image[0, :n] >= 0, video_id)
        assert tokens.tolist() == ids[0].tolist()
        assert "<0.3 seconds>" in proc.tokenizer.decode(ids[0]) or row == 1

        types = 2 * (ids == video_id).long()
        theirs, _ = hf_model.model.get_rope_index(ids, types, None, want["video_grid_thw"])
        positions = batch.slot_data[MROPE_POSITIONS][:, :, :n]
        assert torch.equal(positions[:, 0], theirs[:, 0])

        # the whole model: our frame groups as images of t = 1 vs transformers' video
        t, h, w = want["video_grid_thw"][0].tolist()
        grids = torch.tensor([[1, h, w]] * t)
        with torch.no_grad():
            hf_logits = hf_model(**want).logits
            got = ours_model(ids.masked_fill(ids == video_id, image_id), patches, grids, positions)
        text_slots = ids != video_id
        err = ((got - hf_logits)[text_slots].abs().max() / hf_logits[text_slots].abs().max()).item()
        print(f"row {row}: logits max abs diff / max abs = {err:.2e}")
        assert err < TOL

    # the control: Qwen2.5-VL's vision half (with these settings) keeps the template's wrapper
    # around one video part and writes no timestamps
    alone = dataset(folder, path, lambda f: chat_processor(f, QWEN3_VIDEO))
    ((plain,),) = alone.read(alone.plan(range(1)))
    assert sum(isinstance(p, VideoFrames) for p in plain.parts) == 1
    ((split,),) = data.read(data.plan(range(1)))
    assert sum(isinstance(p, list) for p in plain.parts) < sum(
        isinstance(p, list) for p in split.parts
    )


def test_generate_about_a_video_file_equals_transformers_greedy(setup):
    from titan_vlm.generate import ask_hf

    folder, path, hf_model, proc, frames, meta = setup
    cfg = JobConfig()
    cfg.model.name = "qwen3_vl"  # type: ignore[assignment]
    cfg.model.flavor = "hf"
    cfg.model.hf_path = str(folder)
    model = from_hf_folder(folder).eval()
    clip = str(path.parent / "clip.mp4")
    _, ours = ask_hf(model, cfg, [], QUESTION, False, 6, video=[clip])

    text = proc.apply_chat_template(MESSAGES[:1], tokenize=False, add_generation_prompt=True)
    inputs = reference(proc, frames, meta, text)
    eos = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=eos)
    theirs = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(ours) > 1 and ours == theirs, (ours, theirs)
