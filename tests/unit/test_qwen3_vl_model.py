"""The "qwen3_vl" family's model against transformers' Qwen3VLForConditionalGeneration, on a tiny
folder transformers writes (hf_folders.save_qwen3): the tower's merged embeddings and DeepStack
features, the interleaved M-RoPE, and the whole model's logits on rows with images of two
aspect ratios; each with a negative control (DeepStack dropped or added after the wrong layer,
Qwen2.5-VL's chunked M-RoPE in place of the interleaved one, a position grid not resampled)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_folders import END, IMAGE, START, VOCAB, save_qwen3

from titan_vlm.data.batch import Sample
from titan_vlm.models.common.hf_folder import SafetensorsFiles, weight_files
from titan_vlm.models.common.qwen_vl.images import MROPE_POSITIONS, QwenRule
from titan_vlm.models.common.qwen_vl.mrope import batch_rope_index, mrope_cos_sin
from titan_vlm.models.qwen3_vl.args import Qwen3VLArgs
from titan_vlm.models.qwen3_vl.hf_adapter import export_names, hf_names
from titan_vlm.models.qwen3_vl.images import Qwen3Rule
from titan_vlm.models.qwen3_vl.model import Qwen3VL, from_hf_folder
from titan_vlm.models.qwen3_vl.mrope import interleaved_mrope_cos_sin

TOL = 1e-5
PATCH_DIM = 3 * 2 * 16 * 16  # channels * temporal_patch_size * patch_size^2
IMAGE_GRIDS = torch.tensor([[1, 4, 6], [1, 8, 4]])  # 6 and 8 merged tokens: two aspect ratios


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Qwen3VL, Path]:
    folder = tmp_path_factory.mktemp("qwen3_vl")
    hf = save_qwen3(folder)
    return hf, from_hf_folder(folder).eval(), folder


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def pixels(grids: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grids.prod(-1).sum()), PATCH_DIM, generator=g)


def image_rows(seed: int) -> torch.Tensor:
    """One row: text, an image of 6 tokens, text, an image of 8 tokens, text (the processor's
    expansion: each image's pad tokens between vision_start and vision_end)."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(0, IMAGE, (n,), generator=g).tolist()

    first = [START] + [IMAGE] * 6 + [END]
    second = [START] + [IMAGE] * 8 + [END]
    return torch.tensor([text(3) + first + text(4) + second + text(2)])


def test_vision_tower_and_deepstack_match_transformers(pair: tuple[Any, Qwen3VL, Path]) -> None:
    """Two images of different grids in one packed call: the main merger's embeddings and each
    DeepStack merger's features equal transformers' (its pooler_output, deepstack_features).
    The control: the learned position grid read without resampling gives other embeddings."""
    hf, ours, _ = pair
    x = pixels(IMAGE_GRIDS, seed=1)
    with torch.no_grad():
        out = hf.model.visual(x, grid_thw=IMAGE_GRIDS)
        got = ours.encode(x, IMAGE_GRIDS)
    dim = ours.args.decoder.dim
    theirs = [out.pooler_output, *out.deepstack_features]
    assert got.shape == (6 + 8, 3 * dim) and len(theirs) == 3
    errors = [relative_error(mine, t) for mine, t in zip(got.split(dim, -1), theirs)]
    print(f"vision tower, DeepStack features: max abs diff / max abs = {errors}")
    assert max(errors) < TOL
    # the control: every patch reads position 0's embedding alone (no interpolation)
    plain = Qwen3VL(ours.args)
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        plain.vision.pos_embed.weight[:] = ours.vision.pos_embed.weight[0]
        control = relative_error(plain.encode(x, IMAGE_GRIDS), torch.cat(theirs, -1))
    assert control > 1e-3


def test_interleaved_mrope_matches_transformers(pair: tuple[Any, Qwen3VL, Path]) -> None:
    """cos / sin of random 3-D positions equal transformers' Qwen3VLTextRotaryEmbedding's; the
    chunked layout of Qwen2.5-VL (the control) differs."""
    hf, ours, _ = pair
    d = ours.args.decoder
    positions = torch.randint(0, 50, (3, 2, 9))
    rotary = hf.model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    got_cos, got_sin = interleaved_mrope_cos_sin(
        positions, d.head_dim, d.rope_theta, ours.args.mrope_section
    )
    assert torch.allclose(got_cos[:, 0], cos, atol=1e-6)
    assert torch.allclose(got_sin[:, 0], sin, atol=1e-6)
    chunked, _ = mrope_cos_sin(positions, d.head_dim, d.rope_theta, ours.args.mrope_section)
    assert not torch.allclose(chunked[:, 0], cos, atol=1e-3)


def test_logits_match_transformers(pair: tuple[Any, Qwen3VL, Path]) -> None:
    """A row of text and two images through the whole model: the logits of every text slot equal
    transformers' forward on the same input_ids. Controls: DeepStack dropped, DeepStack added one
    layer late, and Qwen2.5-VL's chunked M-RoPE each give other logits."""
    hf, ours, _ = pair
    ids = image_rows(seed=3)
    px = pixels(IMAGE_GRIDS, seed=4)
    types = (ids == IMAGE).long()
    with torch.no_grad():
        theirs = hf(
            input_ids=ids, pixel_values=px, image_grid_thw=IMAGE_GRIDS, mm_token_type_ids=types
        ).logits
        positions = batch_rope_index(ids, IMAGE_GRIDS, None, None, ours.args)
        got = ours(ids, px, IMAGE_GRIDS, positions)
    text = ids != IMAGE
    err = relative_error(got[text], theirs[text])
    print(f"logits: max abs diff / max abs = {err:.2e}")
    assert got.shape == theirs.shape == (1, ids.shape[1], VOCAB)
    assert err < TOL

    def control(args_change: dict[str, Any] | None = None, decode: Any = None) -> float:
        model = Qwen3VL(dataclasses.replace(ours.args, **(args_change or {})))
        model.load_state_dict(ours.state_dict())
        if decode is not None:
            model.decoder.forward = decode(model.decoder)  # type: ignore[method-assign]
        with torch.no_grad():
            out = model(ids, px, IMAGE_GRIDS, positions)
        return relative_error(out[text], theirs[text])

    def without_deepstack(decoder: Any) -> Any:
        forward = type(decoder).forward
        return lambda tokens, embeds, layout, inline, deepstack: forward(
            decoder, tokens, embeds, layout, inline, []
        )

    def one_layer_late(decoder: Any) -> Any:
        """Feature j added after layer j + 1 (zeros after layer 0)."""
        forward = type(decoder).forward
        return lambda tokens, embeds, layout, inline, deepstack: forward(
            decoder, tokens, embeds, layout, inline, [(deepstack[0][0] * 0, None), *deepstack]
        )

    assert control(decode=without_deepstack) > 1e-3
    assert control(decode=one_layer_late) > 1e-3


def test_hf_names_map_every_parameter(pair: tuple[Any, Qwen3VL, Path]) -> None:
    """Every parameter names a tensor of the files transformers wrote (q, k, v: thirds of the
    fused qkv), every tensor is named, and an export's names are the same."""
    _, ours, folder = pair
    with SafetensorsFiles(weight_files(folder, "f"), "f") as files:
        keys = files.keys()
    names = hf_names(ours.args, keys)
    assert set(names) == {n for n, _ in ours.named_parameters()}
    assert set(names.values()) == keys
    assert export_names(ours.args) == names


def test_video_sizing_sampling_and_timestamps_are_transformers(
    pair: tuple[Any, Qwen3VL, Path],
) -> None:
    """Qwen3VLVideoProcessor's rules, called from transformers itself: a video's frame size from
    the frames' size AND count (with and without cap_pixels_per_frame), which frames of a file
    it keeps, and each frame group's timestamp. Controls: Qwen2.5-VL's per-frame smart_resize
    gives another size; a video part not cut into frame groups is refused, not positioned."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )
    from transformers.video_utils import VideoMetadata

    from titan_vlm.models.common.qwen_vl.processor import vision_settings
    from titan_vlm.models.qwen3_vl.video import (
        QWEN3_VIDEO,
        VIDEO_DEFAULTS,
        Qwen3Sampling,
        group_times,
    )

    _, ours, _ = pair
    low, high = 64 * 32 * 32, 32 * 32 * 60
    rule = Qwen3Rule(ours.args, video_bounds=(low, high))
    capped = Qwen3Rule(ours.args, video_bounds=(low, high), frame_cap=12)
    hf = Qwen3VLVideoProcessor(size={"shortest_edge": low, "longest_edge": high})
    sizes = [(64, 96), (480, 270), (17, 700), (1080, 1920), (20, 20)]
    for (height, width), frames in zip(sizes * 2, [2, 3, 4, 9, 16, 40, 5, 7, 2, 31]):
        want = smart_resize(frames, height, width, 2, 32, low, high)
        assert rule.fit(height, width, frames) == want, (height, width, frames)
        per_frame = max(min(12 * 32 * 32, high // frames), int(low * 1.05))
        want = smart_resize(frames, height, width, 2, 32, low, per_frame * frames)
        assert capped.fit(height, width, frames) == want
        # what the processor's own count says (cap off): the same grid
        patches = hf.get_num_of_video_patches(frames, height, width, {})
        h, w = rule.fit(height, width, frames)
        assert patches == -(-frames // 2) * (h // 16) * (w // 16)
    assert rule.fit(480, 270, 40) != QwenRule(ours.args, video_bounds=(low, high)).fit(480, 270, 40)

    for total, fps, settings in [
        (16, 8.0, {}),
        (300, 30.0, {}),
        (3, 24.0, {}),
        (100, 25.0, {"fps": 1}),
        (50, 10.0, {"fps": None, "num_frames": 7}),
        (90, 30.0, {"fps": None, "max_frames": 20}),
        (3, 24.0, {"fps": None}),
    ]:  # fmt: skip (more than 3: repeats)
        # what preprocess passes sample_frames: the merged settings' fps and num_frames
        hf_sampler = Qwen3VLVideoProcessor(**settings)
        merged = {k: getattr(hf_sampler, k) for k in SAMPLING_KEYS}
        meta = VideoMetadata(total_num_frames=total, fps=fps)
        want = hf_sampler.sample_frames(
            meta, fps=merged["fps"], num_frames=merged["num_frames"]
        ).tolist()
        mine = Qwen3Sampling(True, merged["fps"], merged["num_frames"], merged["min_frames"],
                             merged["max_frames"], 2).indices(total, fps)  # fmt: skip
        assert mine == want, (total, fps, settings)
        times = tuple(i / fps for i in want)
        hf_times = Qwen3VLProcessor._calculate_timestamps(None, want, fps, 2)
        assert group_times(times, 2) == pytest.approx(hf_times, abs=0)
    assert VIDEO_DEFAULTS["size"] == dict(Qwen3VLVideoProcessor().size)
    # Qwen3VLVideoProcessor reads `size` alone: top-level min / max pixels change nothing
    file = {"min_pixels": 1000, "max_pixels": 50000, "size": {"shortest_edge": low,
                                                              "longest_edge": high}}  # fmt: skip
    assert dict(Qwen3VLVideoProcessor(**file).size) == file["size"]
    assert vision_settings(file, "f.json", QWEN3_VIDEO).pixel_bounds == (low, high)

    group = Sample([[1, 2], torch.zeros(2, 3, 64, 96), [3]])  # one frame group: t = 1
    assert rule.positions(group)[MROPE_POSITIONS].shape == (3, 2 + 6 + 1)
    with pytest.raises(ValueError, match="frame groups of 2"):
        rule.positions(Sample([[1], torch.zeros(4, 3, 64, 64), [2]]))


SAMPLING_KEYS = ("fps", "num_frames", "min_frames", "max_frames")


def test_a_built_in_qwen3_vl_model_is_asked_with_its_rule(tmp_path: Path) -> None:
    """generate --checkpoint's path for a built-in model: a Qwen3-VL model is asked with its
    family's image rule and M-RoPE positions (a plain image tensor would not encode), the same ids
    greedy gives the row built by hand."""
    from PIL import Image

    from titan_vlm.config import JobConfig
    from titan_vlm.data.images import load_image
    from titan_vlm.data.tokenizer import ByteTokenizer
    from titan_vlm.generate import ask_built_in_model, greedy

    cfg = JobConfig()
    cfg.model.name = "qwen3_vl"  # type: ignore[assignment]
    torch.manual_seed(0)
    model = Qwen3VL(Qwen3VLArgs()).eval()
    path = tmp_path / "image.png"
    Image.new("RGB", (96, 64), (200, 40, 90)).save(path)
    answer, ids = ask_built_in_model(model, cfg, str(path), "It", 4, chat=False)
    rule = Qwen3Rule(model.args)
    tok = ByteTokenizer()
    prefix = [load_image(str(path), model.image_size), tok.encode("It", eos=False)]
    assert ids == greedy(model, prefix, {tok.EOS}, 4, tok.PAD, None, rule, rule.positions)
    assert len(ids) >= 1 and isinstance(answer, str)
