"""Where the ViT runs inside the CP group (parallelism.cp_vision) changes no number: every mode
reproduces one process, with rows of 0, 1 and 5 images, including ranks that encode no image."""

import pytest
import torch
from test_parity import GRAD_TOL, mismatches, report

from titan_vlm.parallel.context_parallel import image_shard_sizes

MODES = ("replicate", "broadcast", "shard")


def vision_divide_factor(vision: str, cp: int) -> float:
    """What FSDP divides the vision tower's and projector's summed gradient by: cp under
    "replicate" (every CP rank holds the whole gradient already), else 1 (a plain sum)."""
    return float(cp) if vision == "replicate" else 1.0


def assert_divide_factors(result: dict, vision: str, cp: int) -> None:
    want = vision_divide_factor(vision, cp)
    factors = result["divide_factors"]
    assert factors["vision"] == factors["projector"] == [want], factors
    assert factors["decoder"] == [1.0], factors


@pytest.mark.parametrize("images", [0, 1, 5])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("vision", MODES)
def test_every_vision_placement_matches_single_process(pool, vision, cp, images):
    # 2 rows per step: 0, 2 or 10 images to place; text of 45 tokens (padded for every cp)
    results = pool.run("parity", cp=cp, vision=vision, images=images, seq_len=16 * images + 45)
    report(f"cp_vision={vision} cp={cp} images/row={images}", results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"
        assert_divide_factors(result, vision, cp)


def test_shard_mode_leaves_ranks_without_images():
    """The case the parity test above covers at cp=4 with one image per row (2 images, 4 ranks).
    Images of one size split as torch.chunk (DTensor Shard(0)) does."""
    assert image_shard_sizes([16] * 2, 4) == [1, 1, 0, 0]
    assert image_shard_sizes([16] * 10, 4) == [3, 3, 3, 1]
    assert image_shard_sizes([], 2) == [0, 0]
    for n in range(12):
        for cp in (2, 3, 4):
            chunks = [len(c) for c in torch.arange(n).chunk(cp)]
            assert image_shard_sizes([1] * n, cp) == chunks + [0] * (cp - len(chunks))


def test_shard_mode_balances_patches_in_contiguous_ranges():
    """Images of different sizes: contiguous ranges in batch order, the busiest rank's patches
    as few as any contiguous split allows."""
    assert image_shard_sizes([64, 4, 4, 4, 4, 16], 2) == [1, 5]  # 64 | 32
    assert image_shard_sizes([4, 4, 4, 4, 64], 2) == [4, 1]
    assert image_shard_sizes([10, 10, 10, 30], 2) == [3, 1]
    assert image_shard_sizes([30, 1, 1, 1], 4) == [1, 3, 0, 0]  # greedy fill of the best budget


@pytest.mark.parametrize("vision", MODES)
def test_negative_control_each_mode_needs_its_gradient_sum(pool, vision):
    """Without the cp sum of the image-embedding gradient the vision tower's gradient is wrong in
    every mode, with the divide factors unchanged (so the error cannot come from a second bug
    cancelling or standing in for the first)."""
    results = pool.run("parity", cp=2, vision=vision, images=1, seq_len=61, sum_image_grad=False)
    report(f"cp_vision={vision} without the image-gradient sum", results[0])
    for result in results:
        assert result["grad_err"]["vision"] > 100 * GRAD_TOL, mismatches(result)
        assert_divide_factors(result, vision, cp=2)
