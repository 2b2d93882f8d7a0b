"""Multimodal RoPE (M-RoPE) of Qwen2.5-VL: every token has three positions (temporal, height,
width), and each RoPE frequency turns by one of them.

`rope_index` gives a sample's positions [3, L] as transformers' `get_rope_index` does:

    text                 all three advance together, one per token
    an image of merged   its tokens take (t0, h0 + r, w0 + c) at merged row r, column c, with
    grid (t, h/m, w/m)   t0 = h0 = w0 = the position the next text token would have had
    a video              the same, its frame k at temporal position t0 + floor(k * tokens_per_second
                         * second_per_grid_t)
    text after either    resumes at the largest position of the image or video + 1

`mrope_cos_sin` turns positions [3, B, L] into cos / sin [B, 1, L, head_dim] for
common/decoder.py's `apply_rope` (rotate-half layout): frequency j < head_dim / 2 takes the axis
whose `mrope_section` part holds j (the first section temporal, then height, then width), and
frequency j + head_dim / 2 repeats it, which is transformers' `apply_multimodal_rotary_pos_emb`.
With all three positions equal it is plain RoPE.

Text after a video: the rule above (the largest position + 1) is Qwen's own and transformers' up
to 5.2. transformers 5.3 and later resume at the video's start + max(h, w) / m instead, which is
the same unless the video's temporal span exceeds its spatial one (long videos, or large
tokens_per_second * second_per_grid_t): there they give text positions that fall inside the
video's temporal range.
"""

from __future__ import annotations

import torch

from titan_vlm.models.common.decoder import inv_frequencies
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.text_args import Rope

Grid = tuple[int, int, int]


def vision_positions(
    start: int, grid: Grid, merge: int, interval: float | torch.Tensor
) -> torch.Tensor:
    """[3, t * h/m * w/m] (t, h, w) positions of one image or video of patch grid `grid`, its merge
    units in row-major order within each frame, frames in order, offset by `start`; frame k's
    temporal position is start + floor(k * interval) (interval 1 for an image)."""
    t, h, w = grid
    temporal = (torch.arange(t) * interval).long() + start
    rows = torch.arange(h // merge) + start
    cols = torch.arange(w // merge) + start
    tt, hh, ww = torch.meshgrid(temporal, rows, cols, indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1)


def _grids(grid_thw: torch.Tensor | None) -> list[Grid]:
    if grid_thw is None:
        return []
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def _row_positions(
    ids: list[int],
    images: list[Grid],
    videos: list[Grid],
    seconds: torch.Tensor | None,
    args: Qwen25VLArgs,
    row: str,
) -> tuple[torch.Tensor, int, int]:
    """Positions [3, L] of one row's tokens `ids`, taking its images and videos from the front
    of `images` / `videos` (seconds: the videos' second_per_grid_t, aligned with `videos`), and
    how many of each it took."""
    kinds = {args.image_token_id: "image", args.video_token_id: "video"}
    grids = {"image": images, "video": videos}
    used = {"image": 0, "video": 0}
    parts: list[torch.Tensor] = []
    pos = i = 0
    while i < len(ids):
        kind = kinds.get(ids[i])
        if kind is None:  # a run of text
            j = i
            while j < len(ids) and ids[j] not in kinds:
                j += 1
            parts.append((torch.arange(j - i) + pos).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        k = used[kind]
        if k >= len(grids[kind]):
            raise ValueError(f"{row}: {kind} token at {i} but only {k} {kind} grid(s) are given")
        grid = grids[kind][k]
        n = args.vision.tokens(*grid)
        if ids[i : i + n] != [ids[i]] * n:
            raise ValueError(
                f"{row}: {kind} {k} of grid {grid} needs {n} consecutive {kind} tokens at {i}"
            )
        interval: float | torch.Tensor = 1
        if kind == "video":
            per_grid = seconds[k] if seconds is not None else 1
            interval = args.tokens_per_second * per_grid
        block = vision_positions(pos, grid, args.vision.spatial_merge_size, interval)
        parts.append(block)
        pos, i = int(block.max()) + 1, i + n
        used[kind] += 1
    out = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return out, used["image"], used["video"]


def rope_index(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
    args: Qwen25VLArgs,
) -> torch.Tensor:
    """Positions [3, L] (long) of ONE sample's input_ids [L], whose image (video) tokens come in
    runs of vision.tokens(grid) for each of image_grid_thw [n_images, 3] (video_grid_thw
    [n_videos, 3], second_per_grid_ts [n_videos]: seconds per temporal patch, 1 if None) in
    order. Every grid must be used."""
    images, videos = _grids(image_grid_thw), _grids(video_grid_thw)
    out, n_images, n_videos = _row_positions(
        input_ids.tolist(), images, videos, second_per_grid_ts, args, "sample"
    )
    if (n_images, n_videos) != (len(images), len(videos)):
        raise ValueError(
            f"the sample's tokens hold {n_images} image(s) and {n_videos} video(s), "
            f"but {len(images)} and {len(videos)} grids are given"
        )
    return out


def batch_rope_index(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
    args: Qwen25VLArgs,
) -> torch.Tensor:
    """Positions [3, B, L] of rows input_ids [B, L], one sample each (no padding), the grids
    of all rows' images (videos) in batch order, as transformers' processor returns them."""
    images, videos = _grids(image_grid_thw), _grids(video_grid_thw)
    seconds = second_per_grid_ts
    rows = []
    for b, ids in enumerate(input_ids.tolist()):
        out, n_images, n_videos = _row_positions(ids, images, videos, seconds, args, f"row {b}")
        rows.append(out)
        images, videos = images[n_images:], videos[n_videos:]
        seconds = seconds[n_videos:] if seconds is not None else None
    if images or videos:
        raise ValueError(f"{len(images)} image and {len(videos)} video grid(s) are left over")
    return torch.stack(rows, dim=1).to(input_ids.device)


def mrope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: tuple[int, ...],
    rope: Rope | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, B, L] -> cos, sin [B, 1, L, head_dim] (fp32, angles computed in float64 as
    common/decoder.py's tables are), for `apply_rope`. `rope`: the frequencies' scaling
    (text_args.Rope; default none)."""
    if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
        raise ValueError(
            f"mrope_section {mrope_section} must be 3 parts summing to {head_dim // 2}"
        )
    device = positions.device
    inv_freq = inv_frequencies(head_dim, theta, rope or Rope()).to(device)  # [head_dim / 2]
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section)).to(device)
    angles = positions.to(torch.float64)[axis].permute(1, 2, 0) * inv_freq  # [B, L, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, L, head_dim]
    return angles.cos().float(), angles.sin().float()
