"""A JSONL file of conversations with images and a video (a list of frame files) on a Qwen2.5-VL
folder (models/common/qwen_vl/processor.py chat_processor: the folder's tokenizer and chat template
through data/hf_processor.py, its image half QwenVision; images.py QwenRule sizing each image from
its header), against transformers 5 itself, offline:

- each sample's ids, its images and video expanded to their placeholder tokens, equal
  Qwen2_5_VLProcessor's input_ids for the same messages (apply_chat_template, then the processor
  on the rendering with the images and frames), and its label-carrying tokens are the assistant
  turns' alone;
- each image part's pixels, patchified (processor.py patchify_frames), equal transformers'
  pixel_values bit for bit (Qwen2VLImageProcessorPil), the video's its pixel_values_videos (the
  reference frames of tests/unit/test_qwen2_5_vl_processor.py: the PIL image processor's steps on
  each frame, laid out by Qwen2VLVideoProcessor.patchify);
- bad records are skipped and counted (a missing file, an unreadable header, a placeholder count
  mismatch, a video's frames of different sizes);
- ./run_train.sh at CP=2 trains two steps on that folder and file.

The folder: a byte-level BPE tokenizer trained here (Qwen2Tokenizer, Qwen's special tokens), the
Qwen2-VL / Qwen2.5-VL chat template, the PIL image processor's preprocessor_config.json with
pixel bounds that resize the test images to a few merge units, and a tiny model (hf_folders.py)
with the tokenizer's vocabulary and placeholder ids."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from hf_folders import save_qwen
from PIL import Image
from test_qwen2_5_vl_processor import hf_processor, noise_image, video_frames

from titan_vlm.data.batch import IGNORE_INDEX, Prompt, VideoFrames
from titan_vlm.data.images import VideoRef
from titan_vlm.data.jsonl import JsonlDataset
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.images import MROPE_POSITIONS, folder_rule
from titan_vlm.models.common.qwen_vl.processor import chat_processor, patchify_frames
from titan_vlm.models.qwen2_5_vl.hf_config import args_from_hf_config

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_qwen2_vl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The chat template of Qwen2-VL and Qwen2.5-VL's released processors (chat_template.json).
TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# 37x91 grows to MIN_PIXELS, 500x120 shrinks to MAX_PIXELS; frames of 90x70 enter at 112x84
MIN_PIXELS, MAX_PIXELS = 56 * 56 * 2, 28 * 28 * 20
ANSWERS = ["A red circle.", "The first is wider.", "It is 500 pixels wide.", "The dot moves."]
ANSWERS += ["Hi there."]
RECORDS = [
    {
        "image": "tall.png",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"},
            {"from": "gpt", "value": ANSWERS[0]},
        ],
    },
    {
        "images": ["wide.png", "glass.png"],
        "conversations": [
            {"from": "human", "value": "Compare <image> and <image>, please."},
            {"from": "gpt", "value": ANSWERS[1]},
            {"from": "human", "value": "Why?"},
            {"from": "gpt", "value": ANSWERS[2]},
        ],
    },
    {
        "video": [f"clip/{i}.png" for i in range(5)],
        "conversations": [
            {"from": "human", "value": "<video>\nWhat happens?"},
            {"from": "gpt", "value": ANSWERS[3]},
        ],
    },
    {
        "conversations": [
            {"from": "human", "value": "Say hi."},
            {"from": "gpt", "value": ANSWERS[4]},
        ]
    },
    # bad: a missing file, a header Pillow cannot read, two placeholders for one image, and a
    # video whose frames differ in size
    {
        "image": "nowhere.png",
        "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "a"}],
    },
    {
        "image": "broken.png",
        "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "b"}],
    },
    {
        "image": "tall.png",
        "conversations": [
            {"from": "human", "value": "<image> <image>?"},
            {"from": "gpt", "value": "c"},
        ],
    },
    {
        "video": ["clip/0.png", "odd.png"],
        "conversations": [{"from": "human", "value": "<video>?"}, {"from": "gpt", "value": "d"}],
    },
]
GOOD = 4
# what transformers is given for the good records: HF messages, image files, frame files
MESSAGES = [
    [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[0]}]},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
                {"type": "text", "text": ", please."},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[1]}]},
        {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[2]}]},
    ],
    [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[3]}]},
    ],
    [
        {"role": "user", "content": [{"type": "text", "text": "Say hi."}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[4]}]},
    ],
]
IMAGES = [["tall.png"], ["wide.png", "glass.png"], [], []]
VIDEOS = [[], [], [f"clip/{i}.png" for i in range(5)], []]


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer.json trained here with Qwen2's split regex, Qwen's special
    tokens after it, and its tokenizer_config.json (Qwen2Tokenizer, as the released folders)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_vlm.data.tokenizer_classes import QWEN2_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "You are a helpful assistant. system user assistant",
        "What is this? Compare and, please. Why? What happens? Say hi.",
        *ANSWERS,
    ] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_folder(folder: Path):
    """The test folder (module docstring) in `folder`: tokenizer, tiny model, chat template and
    the PIL image processor's settings; returns that image processor."""
    from tokenizers import Tokenizer

    folder.mkdir()
    write_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    vocab = (tok.get_vocab_size() + 15) // 16 * 16
    save_qwen(
        folder,
        vocab=vocab,
        image=ids["<|image_pad|>"],
        video=ids["<|video_pad|>"],
        start=ids["<|vision_start|>"],
        end=ids["<|vision_end|>"],
    )
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    hf = hf_qwen2_vl.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The folder (and its transformers image processor), the JSONL file and its images."""
    root = tmp_path_factory.mktemp("qwen_jsonl")
    folder = root / "qwen"
    hf = write_folder(folder)
    data = root / "data"
    (data / "clip").mkdir(parents=True)
    noise_image(37, 91, "RGB", seed=1).save(data / "tall.png")
    noise_image(500, 120, "RGB", seed=2).save(data / "wide.png")
    noise_image(200, 150, "RGBA", seed=3).save(data / "glass.png")
    for i, frame in enumerate(video_frames(5)):
        frame.save(data / "clip" / f"{i}.png")
    noise_image(64, 48, "RGB", seed=4).save(data / "odd.png")
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    path = data / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return folder, hf, path


def dataset(folder: Path, path: Path, packing: bool = False) -> JsonlDataset:
    config = json.loads((folder / "config.json").read_text())
    args: Qwen25VLArgs = args_from_hf_config(config, str(folder / "config.json"))
    rule = folder_rule(args, str(folder))
    proc = chat_processor(folder)
    return JsonlDataset(
        str(path),
        proc.tokenizer,
        args.image_size,
        args.tokens_per_image,
        512,
        0,
        packing=packing,
        shuffle=False,
        processor=proc,
        rule=rule,
        slot_data=rule.positions,
    )


def reference(setup, i: int) -> dict:
    """transformers' Qwen2_5_VLProcessor on good record i: the folder's chat template rendered
    by apply_chat_template, then the processor on it with the record's images and frames."""
    folder, hf, path = setup
    proc = hf_processor(hf, transformers.AutoTokenizer.from_pretrained(folder))
    proc.chat_template = (folder / "chat_template.jinja").read_text()
    text = proc.apply_chat_template(MESSAGES[i], tokenize=False)
    images = [Image.open(path.parent / name) for name in IMAGES[i]]
    frames = [Image.open(path.parent / name) for name in VIDEOS[i]]
    return proc(
        text=[text],
        images=images or None,
        videos=[frames] if frames else None,
        return_tensors="pt",
    )


def test_samples_equal_transformers(setup):
    folder, hf, path = setup
    data = dataset(folder, path)
    assert sum(data.skipped.values()) == len(RECORDS) - GOOD, data.skipped
    assert set(data.skipped) == {
        "missing image file",
        "image cannot be decoded",
        "placeholder count",
        "video frames of different sizes",
    }
    assert data.num_videos == 1 and "3 image(s) and 1 video(s)" in data.describe()
    third = data.plan(range(3))[2][0]  # unshuffled, one sample a row: the third kept sample
    video = [p for p in data.sample(third).parts if isinstance(p, VideoRef)]
    assert len(video) == 1 and len(video[0].frames) == 5 and video[0].frame_size == (84, 112)

    proc = chat_processor(folder)
    tokens = proc.vision.processor.tokens
    rows = data.read(data.plan(range(GOOD)))
    for i, row in enumerate(rows):
        (sample,) = row
        want = reference(setup, i)
        ids: list[int] = []
        trained: list[int] = []
        pixels, videos = [], []
        for part in sample.parts:
            if isinstance(part, list):
                ids += part
                trained += [] if isinstance(part, Prompt) else part
                continue
            video = isinstance(part, VideoFrames)  # frame files: their rate (24 fps) with them
            part = part.frames if video else part
            frames = part if video else part.unsqueeze(0).expand(2, -1, -1, -1)
            patches, grid = patchify_frames(frames, 14, 2, 2)
            (videos if video else pixels).append((patches, grid))
            token = tokens.video_id if video else tokens.image_id
            assert data.rule is not None
            slots = data.rule.slots(part)
            assert slots == grid[0] * grid[1] * grid[2] // 4
            ids += [token] * slots
        assert ids == want["input_ids"][0].tolist(), i
        if pixels:
            assert torch.equal(torch.cat([p for p, _ in pixels]), want["pixel_values"])
            assert want["image_grid_thw"].tolist() == [list(g) for _, g in pixels]
        else:
            assert "pixel_values" not in want or want["pixel_values"] is None
        if videos:
            assert torch.equal(torch.cat([p for p, _ in videos]), want["pixel_values_videos"])
            assert want["video_grid_thw"].tolist() == [list(g) for _, g in videos]
        # the loss: the answers, each with the template's <|im_end|>\n, and nothing else
        answers = [a["content"][0]["text"] for a in MESSAGES[i] if a["role"] == "assistant"]
        end = proc.tokenizer.encode_text("<|im_end|>\n", False)
        assert trained == [t for a in answers for t in proc.tokenizer.encode_text(a, False) + end]

    # the batch: labels on the trained tokens alone, positions as the rule gives them
    batch = data.batch(0, 0, 1, GOOD)
    for b, row in enumerate(rows):
        labels = batch.labels[b][batch.labels[b] != IGNORE_INDEX].tolist()
        (sample,) = row
        runs = [p for p in sample.parts if isinstance(p, list) and not isinstance(p, Prompt)]
        assert labels == [t for run in runs for t in run]
        n = sample.num_slots(data.slots)
        assert torch.equal(
            batch.slot_data[MROPE_POSITIONS][:, b, :n],
            data.rule.positions(sample)[MROPE_POSITIONS],
        )


def test_packed_index_counts_video_slots(setup):
    """Packed rows: each sample's slots as its window's pass counted them (from headers) are its
    decoded slots."""
    folder, _, path = setup
    data = dataset(folder, path, packing=True)
    for r in range(len(data.windows[0].rows)):
        (refs,) = data.plan(range(r, r + 1))
        (row,) = data.read([refs])
        indexed = [ref.size for ref in refs]
        assert [s.num_slots(data.slots) for s in row] == indexed
        assert [data._num_slots(data.sample(ref)) for ref in refs] == indexed


def test_run_train_cp2(setup, tmp_path):
    folder, _, path = setup
    out = subprocess.run(
        [
            "./run_train.sh",
            "--config",
            "train_configs/vlm_cp.toml",
            "--model.flavor=hf",
            f"--model.hf_path={folder}",
            f"--data.dataset={path}",
            "--training.steps=2",
            "--training.local_batch_size=2",
            "--checkpoint.enable=false",
            "--metrics.enable_tensorboard=false",
            f"--job.dump_folder={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["data_bad_samples"] == len(RECORDS) - GOOD for s in steps)
    assert "1 video(s)" in out.stdout + out.stderr


QUESTIONS = [
    (["tall.png"], None, "What is this?"),
    (["wide.png", "glass.png"], None, "Compare and, please."),
    ([], [f"clip/{i}.png" for i in range(5)], "What happens?"),
    (["wide.png"], None, "<|vision_start|><|image_pad|><|vision_end|>Say hi."),  # --raw-prompt
]


@pytest.mark.parametrize(
    "case", range(len(QUESTIONS)), ids=["image", "two_images", "video", "raw_prompt"]
)
def test_generate_equals_transformers_greedy(setup, tmp_path, capsys, case):
    """titan_vlm.generate's command line (its main, in this process: the subprocess run of the
    same CLI is tests/test_qwen2_5_vl_video.py's) with --hf-path on the folder, asked about one
    image, two images of different aspect ratios, or a video's frames in its chat template, or
    with --raw-prompt (the text the processor takes, each pad its image's tokens): the generated
    ids equal transformers' greedy generate on the processor's inputs for the same text."""
    import shutil

    from titan_vlm.generate import main as generate_main

    folder, hf, path = setup
    asked = tmp_path / "qwen"
    shutil.copytree(folder, asked)
    tok = transformers.AutoTokenizer.from_pretrained(asked)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    (asked / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    images, frames, question = QUESTIONS[case]
    raw = question.startswith("<|vision_start|>")
    argv = ["--hf-path", str(asked), "--prompt", question, "--max-new-tokens", "6", "--print-ids"]
    argv += ["--raw-prompt"] if raw else []
    for name in images:
        argv += ["--image", str(path.parent / name)]
    if frames:
        argv += ["--video", *(str(path.parent / f) for f in frames)]
    generate_main(argv)
    ours = [int(i) for i in capsys.readouterr().out.strip().splitlines()[-1].split()]

    proc = hf_processor(hf, tok)
    proc.chat_template = TEMPLATE
    content = [{"type": "image"} for _ in images] + ([{"type": "video"}] if frames else [])
    content.append({"type": "text", "text": question})
    text = (
        question
        if raw
        else proc.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    )
    inputs = proc(
        text=[text],
        images=[Image.open(path.parent / n) for n in images] or None,
        videos=[[Image.open(path.parent / f) for f in frames]] if frames else None,
        return_tensors="pt",
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(asked).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=eos)
    theirs = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(ours) > 1 and ours == theirs, (ours, theirs)
