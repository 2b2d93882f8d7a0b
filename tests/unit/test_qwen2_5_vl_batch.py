"""Qwen2.5-VL through the trainer's path: samples of text, images and a video (decoded pixels,
data/batch.py parts) packed into one row by collate with the family's rule (models/qwen2_5_vl/
images.py QwenRule: each image's slots from its size, M-RoPE positions per sample as slot data),
then the model's forward_local with a one-process CPContext: every text slot's logits equal
transformers' forward of that sample alone, whose processor-made pixel_values and grids are the
same pixels patchified. The positions computed from a sample's parts equal transformers'
get_rope_index on its expanded ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_folders import END, START, save_qwen
from test_qwen2_5_vl_model import TOL, relative_error, text, token_types

from titan_vlm.data.batch import Sample, collate
from titan_vlm.models.common.qwen_vl.images import MROPE_POSITIONS, QwenRule, QwenVisuals
from titan_vlm.models.common.qwen_vl.mrope import rope_index
from titan_vlm.models.common.qwen_vl.processor import patchify_frames
from titan_vlm.models.qwen2_5_vl.model import Qwen25VL, from_hf_folder
from titan_vlm.parallel.context_parallel import CPContext

FPS = 1.6  # temporal_patch_size 2 / 1.6 fps = 1.25 s a temporal patch: a step of 2.5 positions


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Qwen25VL]:
    folder: Path = tmp_path_factory.mktemp("qwen2_5_vl_batch")
    hf = save_qwen(folder)
    return hf, from_hf_folder(folder).eval()


def _pixels(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    one = Sample(
        [
            text(3, g) + [START],
            _pixels(3, 56, 84, seed=1),  # grid (1, 4, 6): 6 slots
            [END] + text(4, g) + [START],
            _pixels(3, 112, 56, seed=2),  # grid (1, 8, 4): 8 slots
            [END] + text(2, g),
        ]
    )
    two = Sample([text(2, g) + [START], _pixels(4, 3, 56, 112, seed=3), [END] + text(5, g)])
    return [one, two]  # the second: a video of 4 frames, grid (2, 4, 8): 16 slots


def _theirs(hf: Any, rule: QwenRule, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits of one sample alone [L, vocab], and its expanded input_ids [L]."""
    a, v = rule.args, rule.args.vision
    ids: list[int] = []
    kw: dict[str, list] = {"images": [], "image_grids": [], "videos": [], "video_grids": []}
    for part in sample.parts:
        if isinstance(part, list):
            ids += part
            continue
        assert isinstance(part, torch.Tensor)
        video = part.ndim == 4
        frames = part if video else part.unsqueeze(0)
        patches, grid = patchify_frames(
            frames, v.patch_size, v.spatial_merge_size, v.temporal_patch_size
        )
        kind = "video" if video else "image"
        kw[f"{kind}s"].append(patches)
        kw[f"{kind}_grids"].append(grid)
        ids += [a.video_token_id if video else a.image_token_id] * v.tokens(*grid)
    row = torch.tensor([ids])
    inputs: dict[str, Any] = {"input_ids": row, "mm_token_type_ids": token_types(row)}
    if kw["images"]:
        inputs |= {
            "pixel_values": torch.cat(kw["images"]),
            "image_grid_thw": torch.tensor(kw["image_grids"]),
        }
    if kw["videos"]:
        inputs |= {
            "pixel_values_videos": torch.cat(kw["videos"]),
            "video_grid_thw": torch.tensor(kw["video_grids"]),
            "second_per_grid_ts": torch.tensor([rule.seconds_per_grid_t()] * len(kw["videos"])),
        }
    with torch.no_grad():
        return hf(**inputs).logits[0], row[0]


def test_positions_from_parts_equal_get_rope_index(pair: tuple[Any, Qwen25VL]) -> None:
    _, ours = pair
    rule = QwenRule(ours.args, fps=FPS)
    for sample in _samples():
        got = rule.positions(sample)[MROPE_POSITIONS]
        ids = _theirs(pair[0], rule, sample)[1]
        visual = [p for p in sample.parts if isinstance(p, torch.Tensor)]
        images = [rule.grid(p) for p in visual if p.ndim == 3]
        videos = [rule.grid(p) for p in visual if p.ndim == 4]
        want = rope_index(
            ids,
            torch.tensor(images).reshape(-1, 3) if images else None,
            torch.tensor(videos).reshape(-1, 3) if videos else None,
            torch.tensor([rule.seconds_per_grid_t()] * len(videos)) if videos else None,
            ours.args,
        )
        assert torch.equal(got, want)


def test_packed_row_through_forward_local_matches_transformers(pair: tuple[Any, Qwen25VL]) -> None:
    """Both samples packed in one row (plus padding), collated with the family's rule, through
    forward_local: each text slot's logits equal transformers' on that sample alone. A row whose
    slot data holds 1-D positions instead gives other logits (negative control)."""
    hf, ours = pair
    rule = QwenRule(ours.args, fps=FPS)
    samples = _samples()
    size = sum(s.num_slots(rule) for s in samples)
    batch = collate([samples], size + 5, rule, rule.image_size, 0, slot_data=rule.positions)
    assert isinstance(batch.images, QwenVisuals) and batch.images.slots() == [6, 8, 16]
    with torch.no_grad():
        logits, _, layout = ours.forward_local(batch, CPContext())
    text_rows = layout.slots("local").order[0, layout.num_image_tokens :]
    worst = 0.0
    start = 0
    for sample in samples:
        theirs, _ = _theirs(hf, rule, sample)
        n = sample.num_slots(rule)
        for j, row_pos in enumerate(text_rows.tolist()):
            if start <= row_pos < start + n:
                err = relative_error(logits[0, j], theirs[row_pos - start])
                worst = max(worst, err)
        start += n
    print(f"packed row vs transformers, per sample: {worst:.2e}")
    assert worst < TOL
    flat = torch.arange(batch.doc.shape[1]).expand(3, 1, -1).clone()
    batch.slot_data = {MROPE_POSITIONS: flat}
    with torch.no_grad():
        one_d, _, _ = ours.forward_local(batch, CPContext())
    assert relative_error(one_d, logits) > 1e-3
