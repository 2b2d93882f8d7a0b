"""cp_image_tokens = "shard": a split sample's image slots are cut head-tail over the CP group
with its text (an image may be split between ranks), instead of held by every rank; "auto"
builds both layouts and keeps the one whose busiest rank the cost model prices lower.

What must hold, whatever is chosen:
  * every slot of the row is held by exactly one rank, and nothing is replicated when sharded;
  * each rank's block plans compute exactly the visible query-key pairs of the mask rule, also
    an image's query against its own image's slots on other ranks (bidirectional images see
    their later pieces);
  * the attention of P ranks (threads) and the trainer's step (process pool) equal one process,
    and each negative control fails."""

import itertools
import random
from unittest import mock

import pytest
import torch
from test_parity import mismatches, report
from test_placement import MODEL_COST, attention_errors, placed

from titan_vlm.layout import Piece, Slots, build_layout, visible
from titan_vlm.layout import blocks as layout_module


def random_row(seed: int, length: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row (doc, image [1, S]): samples of 4-40 slots, each with up to a few images
    of 1-9 slots at random places, the row's tail unused."""
    rng = random.Random(seed)
    doc = torch.full((1, length), -1)
    image = torch.full((1, length), -1)
    pos = sample = img = 0
    while pos < length - 4:
        n = min(rng.randint(4, 40), length - pos)
        doc[0, pos : pos + n] = sample
        at = pos + rng.randint(0, 3)
        while at < pos + n - 2 and rng.random() < 0.6:
            m = min(rng.randint(1, 9), pos + n - at)
            image[0, at : at + m] = img
            img, at = img + 1, at + m + rng.randint(0, 5)
        pos, sample = pos + n, sample + 1
    return doc, image


def layouts(doc, image, cp, bidirectional, placement, image_tokens, cost=None):
    return [
        build_layout(doc, image, cp, r, bidirectional, 1, placement, cost, None, image_tokens)[1]
        for r in range(cp)
    ]


def computed_pairs(layout) -> torch.Tensor:
    """[local slots, row positions]: how often the plan of the local queries over every slot
    they may see ("all") computes each query-key pair."""
    local, keys = layout.slots("local"), layout.slots("all")
    cover = torch.zeros(len(local), layout.row_positions.shape[1], dtype=torch.long)
    where = keys.order[0]
    for _, qs, ks, causal in layout.blocks("local", "all"):
        block = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.long)
        cover[qs].index_add_(1, where[ks], block.tril() if causal else block)
    return cover


CASES = list(itertools.product([2, 3, 4], [False, True], ["split", "auto"]))


@pytest.mark.parametrize(
    "cp,bidirectional,placement", CASES, ids=[f"cp{c}-bidi{b}-{p}" for c, b, p in CASES]
)
def test_sharded_images_are_held_once_and_planned_exactly(cp, bidirectional, placement):
    sharded = 0
    for seed in range(6):
        doc, image = random_row(seed)
        row = Slots(doc, torch.arange(doc.shape[1])[None], image)
        lays = layouts(doc, image, cp, bidirectional, placement, "shard")
        held = torch.zeros(doc.shape[1], dtype=torch.long)
        for r, lay in enumerate(lays):
            assert lay.replicated_images() == 0  # "shard": no split sample's image on every rank
            section = Slots.cat([lay.texts[r], lay.kept[r]]).order[0]
            held[section[section >= 0]] += 1
            want = visible(lay.slots("local"), row, bidirectional)[0].long()
            assert torch.equal(computed_pairs(lay), want), (seed, r)
            assert lay.rank_work()[r] == int(want.sum())  # the cost model counts those pairs
        assert torch.equal(held, (doc[0] >= 0).long())  # every slot on exactly one rank
        sharded += lays[0].sharded_images()
    assert sharded > 0  # the rows did cut images over the ranks


def test_a_split_image_is_cut_between_ranks_and_placed_from_the_batch_embeddings():
    """One long sample, one 16-slot image, cp=4: the image's slots land on two ranks among
    their text, and each slot's embedding index is its token of that image."""
    doc = torch.zeros(1, 96, dtype=torch.long)
    image = torch.full((1, 96), -1)
    image[0, 20:36] = 0  # 8 chunks of 12 slots: the image is in chunks 1 and 2
    holders = []
    for lay in layouts(doc, image, 4, False, "split", "shard"):
        text_section = Slots.cat([lay.texts[lay.rank], lay.kept[lay.rank]])
        slots = text_section.order[0][text_section.image[0] >= 0]
        assert torch.equal(
            lay.image_index[0, lay.num_image_tokens :][text_section.image[0] >= 0], slots - 20
        )
        assert lay.inline_images == bool(len(slots))
        holders.append(len(slots))
    assert sorted(holders) == [0, 0, 4, 12], holders  # chunk 1 holds 4 of its slots, chunk 2 12


@pytest.mark.parametrize("cp", [2, 4])
def test_auto_image_tokens_keep_the_cheaper_layout_and_never_price_above_either(cp):
    for seed, bidirectional in itertools.product(range(8), [False, True]):
        doc, image = random_row(seed, 160)
        priced = {}
        for mode in ("replicate", "shard", "auto"):
            lay = layouts(doc, image, cp, bidirectional, "auto", mode, MODEL_COST)[0]
            priced[mode] = (max(lay.rank_cost()), lay.sharded_images(), lay.replicated_images())
        assert priced["auto"][0] == min(priced["replicate"][0], priced["shard"][0])
        chosen = (
            "shard" if priced["shard"][0] < priced["replicate"][0] * (1 - 1e-9) else "replicate"
        )
        assert priced["auto"] == priced[chosen]


def test_an_unknown_image_token_mode_is_an_error():
    doc, image = random_row(0)
    with pytest.raises(ValueError, match="cp_image_tokens must be one of"):
        build_layout(doc, image, 2, 0, image_tokens="split")


# ------------------------------------------------------------------------------------------
# Exact attention: P ranks as threads (the rows of test_placement, images sharded)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
def test_attention_over_sharded_images_is_exact(comm, cp, bidirectional):
    errors = attention_errors(comm, cp, bidirectional, "shard")
    assert max(errors) < 1e-5, dict(zip(("out", "dq", "dk", "dv"), errors))


def test_negative_control_a_sharded_image_that_does_not_see_its_later_pieces_fails():
    """Bidirectional: an image query must see its image's slots held after it on other ranks;
    the rule that only sees a piece's own range (replicated images' rule) must break parity."""
    real = layout_module._relation

    def own_range_only(q: Piece, k: Piece, bidirectional_images: bool) -> str | None:
        if q.image >= 0 and q.image == k.image and k.order >= q.order + q.stop - q.start:
            return None
        return real(q, k, bidirectional_images)

    with mock.patch.object(layout_module, "_relation", own_range_only):
        assert max(attention_errors("p2p", 2, True, "shard")) > 1e-2


# ------------------------------------------------------------------------------------------
# The trainer's step on the process pool


def sharded(pool, **case) -> list[dict]:
    """test_placement's `placed` runs (the "long_and_short" rows) with the long sample's images
    sharded."""
    return placed(pool, **{"image_tokens": "shard", **case})


SHARDED = {  # every cp_comm_type and cp_vision, causal and bidirectional, both placements
    "p2p_cp2": dict(comm="p2p", cp=2),
    "a2a_cp4_bidirectional_vision_replicate": dict(
        comm="a2a", cp=4, image_attention="bidirectional", vision="replicate"
    ),
    "allgather_cp2_split_vision_broadcast": dict(
        comm="allgather", cp=2, placement="split", vision="broadcast"
    ),
}


@pytest.mark.parametrize("case", SHARDED.values(), ids=SHARDED.keys())
def test_sharded_image_tokens_match_single_process(pool, case):
    results = sharded(pool, **case)
    report(f"sharded image tokens {case}", results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"
        assert result["sharded_images"] >= 2 and result["replicated_images"] == 0


def test_auto_image_tokens_with_fsdp_and_tp_match_single_process(pool):
    """cp_image_tokens = "auto" on dp_shard=2 x cp=2 over the built-in packed data (every sample
    split, priced by the debug model's weights), and on cp=2 x tp=2 with sequence parallelism
    and the image embeddings sharded over tp (auto placement, priced by attention pairs)."""
    chosen = []
    for case in (
        dict(dp_shard=2, cp=2, packing=True, images=3, seq_len=160, placement="split"),
        dict(cp=2, tp=2, sp=True, image_embed_tp_shard=True, rows="long_and_short", seq_len=192),
    ):
        cost = "model" if case.get("placement") == "split" else "pairs"
        results = pool.run(
            "parity",
            **{"placement": "auto", **case},
            image_tokens="auto",
            placement_cost=cost,
            batch_size=2,
        )
        report(f"auto image tokens {case}", results[0])
        for result in results:
            assert mismatches(result) == [], mismatches(result)
        chosen.append(results[0]["sharded_images"] > 0)
    assert all(chosen)  # both rows price lower with their split samples' images sharded


def test_negative_controls_sharded_images_not_placed_or_not_summed_fail(pool):
    unplaced = mismatches(sharded(pool, cp=2, kept_images_placed=False)[0])
    assert any(p.startswith("loss") for p in unplaced), unplaced
    unsummed = mismatches(sharded(pool, cp=2, sum_image_grad=False)[0])
    assert any(p.startswith("vision gradient") for p in unsummed), unsummed
