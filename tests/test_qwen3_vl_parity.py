"""Qwen3-VL under CP reproduces one process (dist_checks.family_parity, through the family's
ModelSpec and forward_local): the loss, the gradient norm, every parameter's gradient by group
(vision, projector: the main and DeepStack mergers, decoder). Packed rows of images of four sizes
and text; each image slot's row carries its embedding and its DeepStack features together, so
they are replicated, sharded, broadcast and gathered exactly as the embeddings are, and their
gradient is summed over cp once, before the mergers and the tower. Negative controls: DeepStack
features dropped on the ranks other than 0, added one decoder layer late, and the image
gradients not summed over cp.

The mixture-of-experts flavor (debug_moe, the router loss weighted 0.5 so that it shows) adds
the router's load-balancing loss over the global batch: each token counted once whichever rank
holds it (an image-prefix slot every CP rank holds counts 1/cp on each), the counts all-reduced
over dp x cp. Negative control: each rank's router loss from its own counts."""

import pytest
from test_qwen2_5_vl_parity import check

CASES = {
    "p2p_split": dict(cp=2, comm="p2p"),
    "a2a_auto_broadcast": dict(
        cp=2, comm="a2a", placement="auto", image_tokens="auto", vision="broadcast"
    ),
    "cp4_allgather_replicate_vision": dict(
        cp=4, comm="allgather", vision="replicate", image_tokens="shard"
    ),
    "fsdp2_cp2_full_ac": dict(dp_shard=2, cp=2, comm="allgather", ac="full"),
    "tp2_cp2_a2a": dict(cp=2, tp=2, comm="a2a", placement="auto", image_tokens="auto"),
    "moe_ep2": dict(cp=1, dp_shard=2, ep=2, flavor="debug_moe", aux_coef=0.5),
    "moe_ep2_cp2": dict(cp=2, comm="allgather", ep=2, flavor="debug_moe", aux_coef=0.5),
    "moe_hsdp2_cp2_ep2": dict(dp_replicate=2, cp=2, ep=2, flavor="debug_moe", aux_coef=0.5),
    # TP on the attention, the experts split over ep within each tp rank's group
    "moe_tp2_cp2_ep2": dict(cp=2, tp=2, ep=2, comm="p2p", flavor="debug_moe", aux_coef=0.5),
    "moe_ep2_fsdp2_cp2": dict(
        dp_shard=2,
        cp=2,
        comm="p2p",
        ep=2,
        flavor="debug_moe",
        aux_coef=0.5,
        ac="full",
        compile_backend="aot_eager",  # the MoE blocks' other children compiled, one graph each
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_vl_matches_one_process(pool, case):
    results = pool.run("family_parity", family="qwen3_vl", **CASES[case])
    for rank, result in enumerate(results):
        assert not check(result), f"rank {rank}: {check(result)}"
        assert set(result["grad_err"]) == {"vision", "projector", "decoder"}
        if "aux_coef" in CASES[case]:  # the router loss over the global batch, once per token
            assert abs(result["moe_aux_loss"] - result["ref_moe_aux_loss"]) < 1e-6
        if "ep" in CASES[case]:  # the experts split over ep, FSDP over the rest
            names, placements = result["experts"]
            assert names[-1] == "ep" and placements[-1] == "S(0)", result["experts"]
    if CASES[case].get("placement", "split") == "split":
        assert any(r["split_samples"] for r in results)
    else:  # samples kept whole: their image slots (and features) among the text
        assert any(r["kept_samples"] for r in results)


def test_deepstack_negative_controls_fail(pool):
    for fault in ("dropped_off_rank0", "one_layer_late"):
        result = pool.run("family_parity", family="qwen3_vl", cp=2, deepstack_fault=fault)[0]
        assert any("loss" in line for line in check(result)), (fault, check(result))
    unsummed = pool.run("family_parity", family="qwen3_vl", cp=2, sum_image_grad=False)[0]
    assert any(line.startswith("projector grad") for line in check(unsummed)), check(unsummed)


def test_expert_parallel_rows_not_regrouped_by_expert_fail(pool):
    result = pool.run(
        "family_parity", family="qwen3_vl", cp=2, ep=2, flavor="debug_moe", ep_unordered=True
    )[0]
    assert any(line.startswith("decoder grad") for line in check(result)), check(result)


def test_router_loss_from_local_counts_fails(pool):
    result = pool.run(
        "family_parity",
        family="qwen3_vl",
        cp=2,
        flavor="debug_moe",
        aux_coef=0.5,
        local_router_counts=True,
    )[0]
    assert any("loss" in line for line in check(result)), check(result)
