"""Tensor parallelism (and sequence parallelism, and image embeddings sharded over tp) composed
with CP and FSDP / HSDP reproduces one process: loss, every parameter's gradient, the parameters
after one optimizer step (same tolerances as test_parity.py). The negative control forgets the
tp sum of the sequence-parallel norm weights' gradients and must be reported."""

import pytest
from test_parity import GRAD_TOL, mismatches, report
from test_vision_placement import assert_divide_factors

# The debug decoder: 4 query heads, 2 K/V heads: tp=2 leaves 2 and 1 per rank. seq_len 61 is 16
# image + 45 text slots; CP pads each sample's text to a multiple of 2*cp (48), so each CP rank
# holds 16 + 24 = 40 slots, 20 per tp rank under SP; packed rows pad the local slots to a
# multiple of tp.
LAYOUTS_8 = {  # (p2p with TP: the 4-rank layouts below)
    "dp2xcp2xtp2_sp_a2a": dict(dp_shard=2, cp=2, tp=2, sp=True, comm="a2a"),
    "hsdp2xcp2xtp2_sp_image_shard": dict(
        dp_replicate=2, cp=2, tp=2, sp=True, image_embed_tp_shard=True, comm="allgather"
    ),
}
LAYOUTS_4 = {
    # one row with one image: cp rank 1 encodes none, and its TP collectives run on empty tensors
    "cp2xtp2_one_image": dict(cp=2, tp=2, batch_size=1),
    # the image embeddings cross the CP group (broadcast from cp rank 0) at dim/tp width
    "cp2xtp2_sp_image_shard_broadcast": dict(
        cp=2, tp=2, sp=True, image_embed_tp_shard=True, vision="broadcast"
    ),
    # recomputed blocks rerun the TP / SP collectives; the replicated ViT is averaged over cp
    "cp2xtp2_sp_selective_ac_replicate": dict(
        cp=2, tp=2, sp=True, ac="selective", vision="replicate"
    ),
    # no CP (tp alone), with and without images
    "tp2_sp": dict(cp=1, tp=2, sp=True, seq_len=80),
    "tp2_sp_text_only": dict(cp=1, tp=2, sp=True, images=0, seq_len=80),
    # packed rows (samples with 0, 1 and 3 images, one mid-text): local slot counts that SP pads
    "cp2xtp2_sp_packed": dict(cp=2, tp=2, sp=True, rows="mixed", seq_len=128),
}


def check(name: str, results: list[dict], layout: dict) -> None:
    report(name, results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"
        assert_divide_factors(result, layout.get("vision", "shard"), layout.get("cp", 2))
    # the projector really hands dim/tp columns to the CP exchange (debug: 128 / 2); ranks that ran
    # no projector (cp_vision=broadcast, cp rank > 0; text-only rows) report None
    widths = {result["image_embed_width"] for result in results} - {None}
    if layout.get("image_embed_tp_shard", False):
        assert widths == {64}
    else:
        assert widths <= {128}


@pytest.mark.parametrize("layout", LAYOUTS_8.values(), ids=LAYOUTS_8.keys())
def test_8_ranks_dp_cp_tp_match_single_process(pool, layout):
    check(str(layout), pool.run("parity", **layout), layout)


@pytest.mark.parametrize("layout", LAYOUTS_4.values(), ids=LAYOUTS_4.keys())
def test_4_ranks_cp_tp_match_single_process(pool, layout):
    check(str(layout), pool.run("parity", **layout), layout)


def test_negative_control_without_tp_sum_of_sp_norm_grads_fails(pool):
    """SP norms whose weights stay plain per-rank tensors: each tp rank's norm-weight gradient
    covers only its half of the sequence and is never summed over tp. The same harness must
    report the ViT and decoder gradients (both have such norms)."""
    results = pool.run("parity", cp=2, tp=2, sp=True, tp_unreduced_norms=True)
    report("cp2xtp2 SP, norm-weight gradients not summed over tp", results[0])
    for result in results:
        problems = mismatches(result)
        assert any(p.startswith("vision gradient") for p in problems), problems
        assert any(p.startswith("decoder gradient") for p in problems), problems
        assert (
            result["grad_err"]["vision"] > 100 * GRAD_TOL
            and result["grad_err"]["decoder"] > 100 * GRAD_TOL
        )
