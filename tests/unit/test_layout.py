"""The mask rule of packed, interleaved rows, and the block plans that compute it exactly.

The rule (layout.py): a query sees the keys of its own sample at earlier row positions and
itself; with image_attention = "bidirectional" the tokens of one image see each other. These
tests hold the planner to a dense mask built straight from that rule."""

import math

import pytest
import torch

from titan_vlm.attention import planned_attention
from titan_vlm.data.batch import IGNORE_INDEX, Sample, collate
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.layout import Slots, build_layout, visible

TPI = 16  # debug flavor: slots per image


def packed_batch(rows: int = 3, seq_len: int = 200, seed: int = 1):
    return SyntheticCaptions(
        32, TPI, seq_len, seed, sentences_per_image=3, images_per_sample=3, packing=True
    ).batch(0, 0, 1, rows)


def coverage(layout, keys: str | int, key_offset: int, cover: torch.Tensor) -> None:
    """Add 1 for every query-key pair the plan of local queries over `keys` computes."""
    for rows, qs, ks, causal in layout.blocks("local", keys):
        pairs = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.long)
        cover[rows, qs, key_offset + ks.start : key_offset + ks.stop] += (
            pairs.tril() if causal else pairs
        )


@pytest.mark.parametrize(
    "bidirectional", [False, True], ids=["causal_images", "bidirectional_images"]
)
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_plans_compute_every_visible_pair_exactly_once(cp, bidirectional):
    batch = packed_batch()
    for rank in range(cp):
        _, layout = build_layout(batch.doc, batch.image, cp, rank, bidirectional)
        want = visible(layout.slots("local"), layout.slots("all"), bidirectional).long()
        n, t = layout.num_image_tokens, len(layout.texts[0])
        ring = torch.zeros_like(want)  # what the ring computes: the images, then each rank's text
        coverage(layout, "images", 0, ring)
        for src in range(cp):
            coverage(layout, src, n + src * t, ring)
        assert torch.equal(ring, want), (
            f"rank {rank}: ring plans off by {(ring - want).abs().sum()} pairs"
        )
        gathered = torch.zeros_like(want)  # what the all-gather computes: everything at once
        coverage(layout, "all", 0, gathered)
        assert torch.equal(gathered, want)
        assert layout.rank_work()[rank] == int(
            want.sum()
        )  # cp_balance's closed form counts the same pairs
    # what the all-to-all computes: every slot of the row against every slot, for its heads
    everything = layout.slots("all")
    want = visible(everything, everything, bidirectional).long()
    a2a = torch.zeros_like(want)
    for rows, qs, ks, causal in layout.blocks("all", "all"):
        pairs = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.long)
        a2a[rows, qs, ks] += pairs.tril() if causal else pairs
    assert torch.equal(a2a, want)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_split_holds_every_text_slot_once_and_every_image_slot_everywhere(cp):
    batch = packed_batch()
    held = []
    for rank in range(cp):
        index, layout = build_layout(batch.doc, batch.image, cp, rank)
        held.append(index)
        assert torch.equal(
            layout.images.order, build_layout(batch.doc, batch.image, cp, 0)[1].images.order
        )
    text = (batch.doc >= 0) & (batch.image < 0)
    for b in range(batch.num_rows):
        mine = torch.cat([h[b][h[b] >= 0] for h in held]).sort().values
        assert torch.equal(mine, text[b].nonzero().flatten())


def test_positions_restart_at_every_sample():
    rows = [[Sample([[1, 2, 3], torch.zeros(3, 32, 32), [4, 5]]), Sample([[6, 7]])]]
    batch = collate(rows, 30, TPI, 32, pad_id=0)
    index, layout = build_layout(batch.doc, batch.image)
    assert layout.positions[0, :TPI].tolist() == list(range(3, 3 + TPI))  # the image after 3 tokens
    assert layout.positions[0, TPI:].tolist() == [0, 1, 2, 19, 20, 0, 1]
    # labels: text predicts the next text of its sample;
    # nothing predicts an image or crosses samples
    assert batch.labels[0, :3].tolist() == [2, 3, IGNORE_INDEX]
    assert batch.labels[0, 19:23].tolist() == [5, IGNORE_INDEX, 7, IGNORE_INDEX]


@pytest.mark.parametrize(
    "bidirectional", [False, True], ids=["causal_images", "bidirectional_images"]
)
def test_planned_attention_equals_the_dense_masked_softmax(bidirectional):
    batch = packed_batch()
    _, layout = build_layout(batch.doc, batch.image, bidirectional_images=bidirectional)
    local = layout.slots("local")
    mask = visible(local, local, bidirectional)
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch.num_rows, 4, len(local), 8, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    real = (local.doc >= 0)[:, None, :, None]  # padding slots: no output, no gradient
    grad = torch.randn(q.shape, dtype=torch.float64)
    out = planned_attention(
        q.float(), k.float(), v.float(), layout.blocks("local", "local"), "auto"
    )
    (out.double() * grad * real).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask[:, None], float("-inf"))
    ref = torch.softmax(scores, -1).nan_to_num(0) @ v
    (ref * grad * real).sum().backward()
    assert ((out.double() - ref) * real).abs().max() < 1e-5
    for mine, theirs in zip(got, (q.grad, k.grad, v.grad)):
        assert (mine - theirs).abs().max() < 1e-4
    # the negative control: the same check notices a plan that ignores the sample boundaries
    merged = Slots(torch.where(local.doc >= 0, 0, -1), local.order, local.image)
    layout.texts[0] = Slots(
        merged.doc[:, layout.num_image_tokens :],
        local.order[:, layout.num_image_tokens :],
        local.image[:, layout.num_image_tokens :],
    )
    layout.images = Slots(
        merged.doc[:, : layout.num_image_tokens], layout.images.order, layout.images.image
    )
    layout._plans.clear()
    leaky = planned_attention(
        q.float(), k.float(), v.float(), layout.blocks("local", "local"), "auto"
    )
    assert ((leaky.double() - ref) * real).abs().max() > 1e-2
