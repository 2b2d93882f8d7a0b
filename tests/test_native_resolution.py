"""Images of different token counts (data.native_resolution_pixels > 0): each image keeps its
aspect ratio (NativeResolution.fit), takes VLMArgs.image_tokens of its grid, and the ViT
interpolates its learned positions to that grid as transformers' interpolate_pos_encoding does.

Checked here: the ViT against transformers' SigLIP and CLIP towers on non-square images (one at
a time and packed as an ImageList), bit-identity at the native size, a wrong grid order that
must break the comparison; the fit rule; a JSONL file of several aspect ratios and a video
(sizes, slots, <image> expansions, labels); CP parity of a batch of mixed sizes under every
cp_vision mode and both sample placements, with a negative control; one run of the real CLI.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hf_folders import TOWER as HF_TOWER
from PIL import Image
from test_parity import mismatches, report
from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

from titan_vlm.config import ConfigError, JobConfig
from titan_vlm.data import native_resolution
from titan_vlm.data.batch import IGNORE_INDEX, Sample, collate
from titan_vlm.data.chat import chat_question
from titan_vlm.data.images import ImageList, NativeResolution, load_native_image
from titan_vlm.data.jsonl import JsonlDataset
from titan_vlm.data.tokenizer import ByteTokenizer
from titan_vlm.generate import ask_builtin
from titan_vlm.models.llava.args import VLMArgs, get_flavor
from titan_vlm.models.llava.hf_adapter import hf_names
from titan_vlm.models.llava.hf_config import vision_args_from_hf
from titan_vlm.models.llava.model import VLM
from titan_vlm.models.llava.vit import ViT
from titan_vlm.parallel.context_parallel import shard_batch, vision_images_per_rank
from titan_vlm.validate import validate_job

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5  # max abs difference / max abs value, fp32
TOWER = {**HF_TOWER, "num_hidden_layers": 2}  # test_hf_models' tiny tower, one layer fewer
# (height, width) of the test images: non-square both ways, a single patch row, native (16 x 16)
SIZES = [(12, 24), (16, 16), (8, 20), (28, 8), (4, 16)]


def tower(kind: str) -> tuple[torch.nn.Module, VLM]:
    """A tiny transformers vision tower (weights moved off their init values) and our VLM with
    the same tower, weights copied under the HF adapter's names."""
    cls, config = {
        "siglip": (SiglipVisionModel, SiglipVisionConfig(**TOWER)),
        "clip": (CLIPVisionModel, CLIPVisionConfig(**TOWER)),
    }[kind]
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    v = vision_args_from_hf({**config.to_dict(), "model_type": config.model_type}, kind)
    ours = VLM(VLMArgs(vision=v)).eval()
    weights = hf.state_dict()
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, theirs in hf_names(ours.args, set(weights)).items():
            params[name].copy_(weights[theirs])
    return hf, ours


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.rand(3, h, w, generator=g) * 2 - 1 for h, w in SIZES]


@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_vit_matches_transformers_interpolate_pos_encoding(kind):
    hf, ours = tower(kind)
    pictures = images()
    native = NativeResolution(10**6, 4, 16, ours.args.image_tokens)
    with torch.no_grad():
        theirs = [
            hf(pixel_values=x[None], interpolate_pos_encoding=True).last_hidden_state[0]
            for x in pictures
        ]
        for x, t in zip(pictures, theirs):
            assert rel(ours.vision(x[None])[0], t) < TOL, x.shape
            assert len(t) == ours.image_tokens(x.shape[1], x.shape[2])
        # all of them packed as one ImageList: each image's tokens in order, batch order
        packed = ours.vision(ImageList(tuple(pictures), native))
        assert rel(packed, torch.cat(theirs)) < TOL
        # the whole model: embeddings in the same order, [sum of image_tokens, D]
        embeds = ours.encode_images(ImageList(tuple(pictures), native))
        one_by_one = torch.cat([ours.encode_images(x[None])[0] for x in pictures])
        assert embeds.shape == (sum(len(t) for t in theirs), ours.embed_dim)
        assert rel(embeds, one_by_one) < TOL


def test_native_size_is_bit_identical_to_the_fixed_path():
    """At the native grid the positions are the learned table itself, and the ViT computes what
    patches + pos_embed -> blocks computed before interpolation existed."""
    torch.manual_seed(0)
    vit = ViT(get_flavor("debug").vision, "auto").eval()
    x = torch.rand(3, 3, 32, 32) * 2 - 1
    assert vit.position_embeddings(4, 4) is vit.pos_embed
    with torch.no_grad():
        h = vit.patch_embed(x).flatten(2).transpose(1, 2) + vit.pos_embed
        for layer in vit.layers:
            h = layer(h)
        assert torch.equal(vit(x), vit.norm(h))


def test_a_wrong_grid_order_breaks_the_comparison():
    """Negative control: positions interpolated to the transposed grid (cols x rows, then read
    as rows x cols) are what a row/column mix-up gives; transformers must then disagree."""
    hf, ours = tower("siglip")
    x = images()[0]  # 12 x 24: 3 x 6 patches

    def transposed(self, rows: int, cols: int) -> torch.Tensor:
        side = self.args.image_size // self.args.patch_size
        grid = self.pos_embed.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(cols, rows), mode="bicubic", align_corners=False)
        return grid.permute(0, 3, 2, 1).reshape(rows * cols, -1)

    with torch.no_grad():
        theirs = hf(pixel_values=x[None], interpolate_pos_encoding=True).last_hidden_state[0]
        with mock.patch.object(ViT, "position_embeddings", transposed):
            assert rel(ours.vision(x[None])[0], theirs) > 100 * TOL


def test_fit_keeps_the_aspect_ratio_within_the_pixel_budget():
    fit = NativeResolution(1024, 8, 32, get_flavor("debug").image_tokens).fit
    assert fit(100, 50) == (40, 16)  # shrunk by sqrt(1024 / 5000), sides rounded down
    assert fit(32, 32) == (32, 32)  # fits: unchanged
    assert fit(30, 20) == (24, 16)  # fits, cut to whole patches, never upscaled
    assert fit(3, 5) == (8, 8)  # smaller than a patch: one patch a side
    assert fit(1, 1000) == (8, 128)  # one patch row takes the others' room: 16 patches
    rng = random.Random(0)
    for _ in range(500):
        h, w = rng.randint(1, 3000), rng.randint(1, 3000)
        fh, fw = fit(h, w)
        assert fh * fw <= 1024 and fh % 8 == 0 and fw % 8 == 0 and min(fh, fw) >= 8
    with pytest.raises(ValueError, match="less than one 8x8 patch"):
        NativeResolution(63, 8, 32, get_flavor("debug").image_tokens).fit(10, 10)


# -- data: a JSONL file of several aspect ratios and a video ---------------------------------

PIXELS = 2 * 32 * 32  # data.native_resolution_pixels in these tests (debug flavor: 8 px patches)
# file -> (width, height) as written, and the (H, W) it enters the ViT at under PIXELS
PNGS = {
    "wide.png": ((90, 30), (24, 72)),  # 2048 / 2700 of its pixels: sides 26.1 x 78.4
    "tall.png": ((20, 70), (64, 16)),  # fits: cut down to whole patches
    "square.png": ((32, 32), (32, 32)),  # the native size
    "tiny.png": ((5, 6), (8, 8)),  # one patch
}
FRAMES = [f"clip/{i}.png" for i in range(3)]  # 48 x 36 frames: fit, cut to 32 x 48


def save(path: Path, width: int, height: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)


@pytest.fixture
def folder(tmp_path):
    for i, (name, ((w, h), _)) in enumerate(PNGS.items()):
        save(tmp_path / name, w, h, i)
    (tmp_path / "clip").mkdir()
    for i, frame in enumerate(FRAMES):
        save(tmp_path / frame, 48, 36, 10 + i)
    (tmp_path / "junk.png").write_bytes(b"\x00 not an image" * 10)
    records = [
        {
            "images": ["wide.png", "tall.png"],
            "conversations": [
                {"from": "human", "value": "<image> or <image>?"},
                {"from": "gpt", "value": "The wide one."},
            ],
        },
        {"image": "square.png", "text": "A square <image> and more."},
        {"video": FRAMES, "text": "It moves: <video> then stops."},
        {"image": "tiny.png", "text": "tiny."},
        {"image": "junk.png", "text": "a header Pillow cannot read."},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def native_data(folder: Path, **kw) -> JsonlDataset:
    args = get_flavor("debug")
    native = NativeResolution(PIXELS, 8, 32, args.image_tokens)
    return JsonlDataset(
        str(folder / "train.jsonl"), ByteTokenizer(), 32, 16, 512, 0, shuffle=False,
        native=native, **kw,
    )  # fmt: skip


def test_jsonl_images_keep_their_aspect_ratio_and_take_their_grid_of_slots(folder):
    data = native_data(folder, packing=True)
    # the junk file's header is read at start-up: a bad sample there, not a dropped row later
    assert data.bad_samples(1) == 1 and data.skipped["image cannot be decoded"] == 1
    batch = data.batch(0, 0, 1, 1)
    assert isinstance(batch.images, ImageList)
    frame = (32, 48)
    want = [PNGS["wide.png"][1], PNGS["tall.png"][1], (32, 32), frame, frame, frame, (8, 8)]
    assert batch.images.sizes() == want
    args = get_flavor("debug")
    for i, (h, w) in enumerate(want):
        slots = batch.image[0] == i
        assert int(slots.sum()) == args.image_tokens(h, w) == (h // 8) * (w // 8)
        assert (batch.labels[0][slots] == IGNORE_INDEX).all()  # nothing predicts an image
        assert (batch.tokens[0][slots] == ByteTokenizer.IMAGE).all()
        at = slots.nonzero()[:, 0]
        assert int(at[-1] - at[0]) + 1 == len(at)  # consecutive slots
        if i + 1 < len(want):  # the slots before the next image's: the text between
            assert int(at[-1]) < int((batch.image[0] == i + 1).nonzero()[0, 0])
    # the decoded pixels: the file resized (bicubic) to its fitted size
    assert torch.equal(batch.images.tensors[0], load_native_image(folder / "wide.png", data.native))
    # the text around the video's frames, in reading order
    text = batch.tokens[0][(batch.doc[0] == 2) & (batch.image[0] < 0)].tolist()
    assert ByteTokenizer().decode(text[1:-1]) == "It moves:  then stops."
    # the CP cost of each rank's ViT work is in native-image units
    assert vision_images_per_rank(batch.images, 2, "replicate") == [sum(
        (h // 8) * (w // 8) / 16 for h, w in want
    )] * 2  # fmt: skip


def test_native_resolution_keys(folder):
    cfg = JobConfig()
    assert native_resolution(cfg, get_flavor("debug")) is None
    cfg.data.dataset = str(folder / "train.jsonl")
    for value, message in (
        (-1, "data.native_resolution_pixels must be >= 0"),
        (40, "data.native_resolution_pixels=40 is less than one 8x8 patch"),
    ):
        cfg.data.native_resolution_pixels = value
        with pytest.raises(ConfigError, match=message):
            validate_job(cfg, 1)
    cfg.data.native_resolution_pixels = PIXELS
    validate_job(cfg, 1)
    cfg.compile.enable = True  # compiled blocks take the packed images' plan
    validate_job(cfg, 1)
    cfg.compile.enable = False
    cfg.data.dataset = "synthetic"
    with pytest.raises(ConfigError, match="the synthetic data draws every image"):
        validate_job(cfg, 1)
    # a Hugging Face folder's processor fixes the size (validate_job says so before any rank
    # starts, for a real folder; the dataset refuses the pair too)
    with pytest.raises(ConfigError, match="does not combine with model.hf_path"):
        native_data(folder, processor=object())


def test_generate_asks_about_an_image_at_its_own_size(folder):
    """generate's greedy decoding with a native-resolution image: its first answer id is the
    argmax of one forward of the same prompt collated as a batch (the ImageList path)."""
    torch.manual_seed(0)
    model = VLM(get_flavor("debug")).eval()
    native = NativeResolution(PIXELS, 8, 32, model.image_tokens)
    image = load_native_image(folder / "wide.png", native)
    tok = ByteTokenizer()
    _, ids = ask_builtin(model, image, "Which?", 3, tok, chat=True, rule=native)
    prefix = chat_question(image, "Which?", tok)
    batch = collate([[Sample(prefix)]], Sample(prefix).num_slots(native), native, 32, tok.PAD)
    assert isinstance(batch.images, ImageList) and batch.images.sizes() == [(24, 72)]
    tokens, _, layout = shard_batch(batch, None)
    with torch.no_grad():
        assert int(model(batch.images, tokens, layout)[0, -1].argmax()) == ids[0]


# -- CP parity of a batch of mixed sizes (dist_checks.special_rows("native")) -----------------

CASES = {
    "shard-split": dict(vision="shard"),
    "shard-auto": dict(vision="shard", placement="auto"),
    "replicate-auto": dict(vision="replicate", placement="auto"),
    "broadcast-auto": dict(vision="broadcast", placement="auto"),
    "shard-auto-dp2xcp2": dict(vision="shard", placement="auto", dp_shard=2, batch_size=1),
    "broadcast-split-tp2": dict(vision="broadcast", tp=2),
    # the split samples' images of mixed sizes cut over the ranks with their text
    "shard-split-image-tokens-shard": dict(vision="shard", image_tokens="shard"),
    # a CLIP-shaped tower (class token, its position interpolated around, then dropped)
    "shard-auto-hf-features": dict(vision="shard", placement="auto", hf_features=True),
    # sequence parallelism: the packed images padded to whole tp slices (ViT.sequence_multiple)
    "tp2-sp-no-cp": dict(cp=1, tp=2, sp=True),
    # ... with CP (compiled: test_compiled_sequence_parallel_over_steps_matches_eager)
    "shard-auto-cp2xtp2-sp": dict(vision="shard", placement="auto", tp=2, sp=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_mixed_sizes_match_single_process(pool, case):
    case = {"cp": 2, "placement_cost": "model", **case}
    results = pool.run("parity", rows="native", seq_len=100, **case)
    report(f"native resolution {case}", results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"
        if case.get("image_tokens") == "shard":  # images of different sizes cut over the ranks
            assert result["sharded_images"] > 0 and result["replicated_images"] == 0


def test_negative_control_uneven_gather_needs_its_gradient_sum(pool):
    """image_grad_placement patched to Replicate: the uneven all-gather's backward no longer
    sums the image-embedding gradient over cp, and the vision tower's gradient is wrong."""
    results = pool.run("parity", rows="native", seq_len=100, cp=2, sum_image_grad=False)
    for result in results:
        assert result["grad_err"]["vision"] > 0.1, mismatches(result)


def test_negative_control_sequence_parallel_norms_need_their_reduction(pool):
    """The SP norms' weights kept local (their gradients not summed over tp, as
    test_tensor_parallel's control): the packed, padded ViT sequence under SP must then fail
    parity, so the SP cases above can fail."""
    results = pool.run("parity", rows="native", seq_len=100, cp=1, tp=2, sp=True,
                       tp_unreduced_norms=True)  # fmt: skip
    for result in results:
        assert any(p.startswith("vision gradient") for p in mismatches(result)), result


def test_compiled_sequence_parallel_over_steps_matches_eager(pool, folder, tmp_path):
    """The trainer on the JSONL of mixed sizes and a video, TP with SP, every block compiled
    (aot_eager, fullgraph): steps whose images differ in count and size, so the ViT blocks take
    other packed plans; no graph break, two graphs per block, and every step's loss equal to the
    same run eager."""
    run = dict(
        dp_shard=1,
        cp=1,
        tp=2,
        steps=4,
        data__dataset=str(folder / "train.jsonl"),
        data__native_resolution_pixels=PIXELS,
        data__shuffle=False,
        parallelism__enable_sequence_parallel=True,
        training__seq_len=160,
        training__local_batch_size=2,
        metrics__enable_tensorboard=False,
        checkpoint__enable=False,
    )
    eager = pool.run("train_run", job__dump_folder=str(tmp_path / "e"), **run)[0]
    compiled = pool.run(
        "compiled_train_run",
        compile__backend="aot_eager",
        job__dump_folder=str(tmp_path / "c"),
        **run,
    )
    for result in compiled:
        assert result["graph_breaks"] == 0
        assert len(result["shapes"]["vit"]) == 2, result["shapes"]  # two packed image sets
        assert result["graphs"] == {"vit": 2, "decoder": 2}, result["graphs"]
        got = [h["loss"] for h in result["history"]]
        assert got == pytest.approx([h["loss"] for h in eager], rel=1e-5)


# -- the real command line --------------------------------------------------------------------


def test_train_script_on_mixed_sizes_and_a_video(folder, tmp_path):
    out = subprocess.run(
        [
            "./run_train.sh",
            "--config",
            "train_configs/vlm_cp.toml",
            f"--data.dataset={folder / 'train.jsonl'}",
            f"--data.native_resolution_pixels={PIXELS}",
            "--data.shuffle=false",
            "--parallelism.context_parallel_degree=2",
            "--training.steps=2",
            "--training.seq_len=160",
            "--training.local_batch_size=2",
            "--checkpoint.enable=false",
            "--metrics.enable_tensorboard=false",
            f"--job.dump_folder={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cp=2" in out.stdout and f"images at native resolution up to {PIXELS}" in out.stdout
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(s["loss"])) and s["ntokens"] > 0 for s in steps)
    assert all(s["data_bad_samples"] == 1 for s in steps)  # the junk file's sample
