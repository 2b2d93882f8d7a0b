"""Per-sample head-tail CP sharding balances the attention work, image slots included.

Work of a CP rank = the query-key pairs its queries (every image slot of the row + its text)
compute against the whole row under the mask rule (SeqLayout.rank_work), what the ring and
all-gather algorithms execute. Reported per training step as `cp_balance` = max/mean."""

from pathlib import Path

import pytest
import torch

from titan_vlm.config import load_config
from titan_vlm.data.batch import Sample, collate
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.layout import SeqLayout, Slots, build_layout, head_tail_pairs
from titan_vlm.models.llava.args import get_flavor

N_IMAGE, TEXT = 64, 4000
DEFAULT_CONFIG = Path(__file__).parents[2] / "train_configs" / "vlm_cp.toml"


def contiguous_split(doc: torch.Tensor, image: torch.Tensor, cp: int) -> SeqLayout:
    """The split head-tail replaces: rank r takes the r-th of P equal pieces of each row's text,
    blind to sample boundaries."""
    _, layout = build_layout(doc, image)
    texts = []
    for r in range(cp):
        pieces = []
        for b in range(doc.shape[0]):
            text = ((doc[b] >= 0) & (image[b] < 0)).nonzero().flatten()
            text = torch.nn.functional.pad(text, (0, -len(text) % cp), value=-1)
            pieces.append(text.view(cp, -1)[r])
        texts.append(Slots.gather(doc, image, torch.nn.utils.rnn.pad_sequence(pieces, True, -1)))
    return SeqLayout(
        layout.positions, layout.images, texts, 0, layout.image_counts, layout.row_positions
    )


def undealt_head_tail(doc: torch.Tensor, image: torch.Tensor, cp: int) -> SeqLayout:
    """Per-sample head-tail with rank r always taking pair r (chunks r and 2P-1-r), not dealt
    by cost: what the dealing improves on."""
    _, layout = build_layout(doc, image)
    texts = []
    for r in range(cp):
        rows = []
        for b in range(doc.shape[0]):
            shares = [
                head_tail_pairs(((doc[b] == s) & (image[b] < 0)).nonzero().flatten(), cp)[r]
                for s in torch.unique_consecutive(doc[b][doc[b] >= 0]).tolist()
            ]
            rows.append(torch.cat(shares))
        texts.append(Slots.gather(doc, image, torch.nn.utils.rnn.pad_sequence(rows, True, -1)))
    return SeqLayout(
        layout.positions, layout.images, texts, 0, layout.image_counts, layout.row_positions
    )


def one_long_sample(cp: int, split: str) -> SeqLayout:
    rows = [[Sample([torch.zeros(3, 8, 8)] * (N_IMAGE // 16) + [list(range(TEXT))])]]
    batch = collate(rows, N_IMAGE + TEXT, 16, 8, pad_id=0)
    if split == "head_tail":
        return build_layout(batch.doc, batch.image, cp)[1]
    return contiguous_split(batch.doc, batch.image, cp)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_head_tail_balances_one_long_sample(cp):
    head_tail, contiguous = (
        one_long_sample(cp, "head_tail").balance(),
        one_long_sample(cp, "contiguous").balance(),
    )
    print(
        f"cp={cp}: max/mean head-tail {head_tail:.4f}, contiguous {contiguous:.4f} "
        f"(text-only bound (2P-1)/P = {(2 * cp - 1) / cp:.3f})"
    )
    assert head_tail <= 1.05
    assert contiguous > 1.3  # the split head-tail is there to fix: the last rank does most work
    assert contiguous == pytest.approx((2 * cp - 1) / cp, rel=0.1)


def test_work_counts_every_row_pair_once():
    """Summed over ranks, the work is the whole row's causal triangle (nothing lost or doubled
    except the image queries, which every rank computes)."""
    cp = 4
    total = sum(one_long_sample(cp, "head_tail").rank_work())
    n = N_IMAGE + TEXT
    image_queries = N_IMAGE * (N_IMAGE + 1) // 2
    assert total == n * (n + 1) // 2 + (cp - 1) * image_queries


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_packed_default_workload_is_balanced(cp):
    """The built-in packed data of the default config: every step's cp_balance <= 1.10."""
    cfg = load_config(["--config", str(DEFAULT_CONFIG)])
    assert cfg.data.packing, "the default config trains packed rows"
    args = get_flavor(cfg.model.flavor)
    t = cfg.training
    data = SyntheticCaptions(
        args.vision.image_size,
        args.tokens_per_image,
        t.seq_len,
        t.seed,
        cfg.data.sentences_per_image,
        images_per_sample=cfg.data.images_per_sample,
        packing=True,
    )
    head_tail, undealt, contiguous = [], [], []
    for step in range(10):
        batch = data.batch(step, 0, 1, t.local_batch_size)
        head_tail.append(build_layout(batch.doc, batch.image, cp)[1].balance())
        undealt.append(undealt_head_tail(batch.doc, batch.image, cp).balance())
        contiguous.append(contiguous_split(batch.doc, batch.image, cp).balance())
    print(
        f"cp={cp}, 10 steps of {t.local_batch_size} x {t.seq_len}, cp_balance worst / mean: "
        f"per-sample head-tail dealt by cost {max(head_tail):.3f} / "
        f"{sum(head_tail) / 10:.3f}; pair r to rank r "
        f"{max(undealt):.3f} / {sum(undealt) / 10:.3f}; contiguous split {max(contiguous):.3f} / "
        f"{sum(contiguous) / 10:.3f}"
    )
    assert max(head_tail) <= 1.10
    assert sum(contiguous) > sum(head_tail) and sum(undealt) > sum(head_tail)
