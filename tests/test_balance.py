"""Head-tail CP sharding balances the causal attention work, image prefix included."""

import pytest
import torch

from titan_vlm.parallel.context_parallel import attention_work, head_tail_indices, padded_text_len

N_IMAGE, TEXT = 64, 4000


def work_per_rank(cp: int, split: str) -> list[int]:
    """Unmasked query-key pairs each rank computes for one row: its queries (all image tokens +
    its text) against every key of the row."""
    padded = padded_text_len(TEXT, cp)
    all_positions = torch.arange(N_IMAGE + padded)
    image = torch.arange(N_IMAGE)
    work = []
    for r in range(cp):
        if split == "head_tail":
            text = head_tail_indices(padded, cp, r)
        else:  # contiguous: rank r takes the r-th of P equal pieces
            piece = padded // cp
            text = torch.arange(r * piece, (r + 1) * piece)
        work.append(attention_work(torch.cat([image, N_IMAGE + text]), all_positions))
    return work


def imbalance(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_head_tail_balances_attention_work(cp):
    head_tail, contiguous = imbalance(work_per_rank(cp, "head_tail")), imbalance(work_per_rank(cp, "contiguous"))
    print(f"cp={cp}: max/mean head-tail {head_tail:.4f}, contiguous {contiguous:.4f} "
          f"(text-only bound (2P-1)/P = {(2 * cp - 1) / cp:.3f})")
    assert head_tail <= 1.05
    assert contiguous > 1.3  # the split head-tail is there to fix: the last rank does most work
    assert contiguous == pytest.approx((2 * cp - 1) / cp, rel=0.1)


def test_work_counts_every_row_pair_once():
    """Summed over ranks, the work is the whole row's causal triangle (nothing lost or doubled
    except the image queries, which every rank computes)."""
    cp = 4
    total = sum(work_per_rank(cp, "head_tail"))
    n = N_IMAGE + padded_text_len(TEXT, cp)
    image_queries = N_IMAGE * (N_IMAGE + 1) // 2
    assert total == n * (n + 1) // 2 + (cp - 1) * image_queries
