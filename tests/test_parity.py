"""CP and FSDP reproduce one process: loss, the gradient norm before clipping, every parameter's
gradient, the parameters after one optimizer step. The negative control shows the harness can
fail.

Every parity case here and in test_packing.py, test_vision_placement.py, test_tensor_parallel.py
runs with eager blocks; `--compile-backend aot_eager` (or `inductor`) reruns them all with each
ViT and decoder block compiled by that backend (fullgraph), e.g.

    python -m pytest tests/test_parity.py tests/test_packing.py tests/test_vision_placement.py \
        tests/test_tensor_parallel.py --compile-backend aot_eager

CI runs them eager, plus test_compile.py's compiled layouts."""

import pytest

LOSS_TOL = 1e-5  # relative
GRAD_TOL = 1e-4  # relative, per parameter: norm(g - g_ref) / norm(g_ref)
# relative, per parameter, after the AdamW step. Adam's first step is about lr * sign(g), so
# gradient elements near zero turn their rounding into whole-lr differences: measured up to
# 5e-5, so the gradient's tolerance.
PARAM_TOL = 1e-4
# absolute, for the ViT key biases, whose exact gradient is zero (dist_checks.ZERO_GRAD_SUFFIXES);
# measured ~4e-11, while the smallest other parameter gradient of this model is ~4e-4
ZERO_GRAD_ABS_TOL = 1e-7

LAYOUTS = {
    "cp2": dict(cp=2),
    "cp4": dict(cp=4),
    "dp2xcp2": dict(dp_shard=2, cp=2),
    "hsdp_rep2xcp2": dict(dp_replicate=2, cp=2),
}
# The debug decoder has 4 query heads and 2 K/V heads (grouped-query attention); at cp=4 "a2a"
# expands the K/V heads, at cp=2 it splits them.
COMM_TYPES = ("p2p", "allgather", "a2a")
# debug flavor: 16 image tokens. Text 64 divides by 2*cp for every layout; text 45 needs padding.
SEQ_LENS = {"text64": 80, "text45_padded": 61}


def mismatches(result: dict) -> list[str]:
    """Everything in one rank's parity result that is out of tolerance, as readable lines."""
    out = []
    loss_err = abs(result["loss"] - result["ref_loss"]) / abs(result["ref_loss"])
    if loss_err > LOSS_TOL:
        out.append(f"loss {result['loss']} vs {result['ref_loss']} (rel {loss_err:.2e})")
    # The pre-clip gradient norm: clipping and AdamW's per-element normalisation hide a gradient
    # scaled uniformly (averaged instead of summed over dp), so it is compared on its own.
    norm_err = abs(result["grad_norm"] - result["ref_grad_norm"]) / abs(result["ref_grad_norm"])
    if norm_err > GRAD_TOL:
        out.append(
            f"grad norm before clipping {result['grad_norm']} vs {result['ref_grad_norm']} "
            f"(rel {norm_err:.2e})"
        )
    if result["missing_grads"]:
        out.append(f"gradient on one side only: {result['missing_grads'][:3]}")
    if result["ntokens"] != result["ref_ntokens"]:
        out.append(f"text tokens {result['ntokens']} vs {result['ref_ntokens']}")
    if result["zero_grad_abs"] > ZERO_GRAD_ABS_TOL:
        out.append(
            f"a gradient that is zero in exact arithmetic has norm {result['zero_grad_abs']:.2e}"
        )
    for group, err in result["grad_err"].items():
        if err > GRAD_TOL:
            out.append(f"{group} gradient rel err {err:.2e}")
    for group, err in result["param_err"].items():
        if err > PARAM_TOL:
            out.append(f"{group} parameters after step rel err {err:.2e}")
    return out


def report(name: str, result: dict) -> None:
    grads = ", ".join(f"{g} {e:.1e}" for g, e in result["grad_err"].items())
    print(f"{name}: loss {result['loss']:.7f} (ref {result['ref_loss']:.7f}); grad rel err {grads}")


@pytest.mark.parametrize("seq_len", SEQ_LENS.values(), ids=SEQ_LENS.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_one_step_matches_single_process(pool, comm, layout, seq_len):
    results = pool.run("parity", comm=comm, seq_len=seq_len, **layout)
    report(f"{comm} {layout} seq_len={seq_len}", results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_bidirectional_image_attention_matches_single_process(pool, comm, cp):
    """The tokens of one image see each other (model.image_attention = "bidirectional"), in
    packed rows with 0, 1 and 3 images per sample: every cp_comm_type's plans carry the dense
    image blocks beside the causal text ones."""
    results = pool.run(
        "parity",
        comm=comm,
        cp=cp,
        rows="mixed",
        seq_len=128,
        batch_size=2,
        image_attention="bidirectional",
    )
    report(f"packed mixed, bidirectional images, {comm} cp={cp}", results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"


@pytest.mark.parametrize("comm", COMM_TYPES)
def test_negative_control_without_image_grad_sum_fails(pool, comm):
    """Switch off the cp all-reduce of the image-embedding gradient: each rank's vision tower
    then trains on its own text's gradient only, and the same harness must report it."""
    results = pool.run("parity", comm=comm, cp=2, seq_len=61, sum_image_grad=False)
    report(f"{comm} cp2 without image-grad sum", results[0])
    for result in results:
        problems = mismatches(result)
        assert any(p.startswith("vision gradient") for p in problems), problems
        assert any(p.startswith("projector gradient") for p in problems), problems
        assert result["grad_err"]["vision"] > 100 * GRAD_TOL


@pytest.mark.parametrize("comm", COMM_TYPES)
def test_bf16_mixed_precision_stays_within_bf16_rounding(pool, comm):
    """bf16 parameters and compute (fp32 gradient reduction) against the fp32 single process:
    the same model up to bf16 rounding (measured: loss ~1e-4, gradients ~1e-2 relative)."""
    result = pool.run("parity", comm=comm, cp=2, seq_len=61, mixed_precision="bf16")[0]
    report(f"{comm} cp2 bf16", result)
    assert abs(result["loss"] - result["ref_loss"]) / result["ref_loss"] < 1e-3
    assert max(result["grad_err"].values()) < 3e-2


def test_hsdp_without_cp_matches_single_process(pool):
    """dp_replicate=2 x dp_shard=2: sharded within a replica, all-reduced across replicas."""
    results = pool.run("parity", dp_replicate=2, dp_shard=2, cp=1)
    report("dp_replicate=2 x dp_shard=2", results[0])
    for result in results:
        assert mismatches(result) == []


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_activation_checkpointing_changes_no_number(pool, comm, ac):
    """Recomputing blocks in backward reruns the CP attention (collectives included) exactly."""
    results = pool.run("parity", comm=comm, cp=2, seq_len=61, ac=ac)
    report(f"{comm} cp2 activation_checkpoint={ac}", results[0])
    for result in results:
        assert mismatches(result) == []


def test_torch_compile_with_cp_matches_single_process(pool):
    """Each ViT and decoder block compiled (aot_eager: one traced graph per block, fullgraph),
    CP=2 ring attention, FSDP. test_compile.py covers the other layouts and inductor."""
    results = pool.run("parity", comm="p2p", cp=2, seq_len=61, compile_backend="aot_eager")
    report("p2p cp2 compiled blocks (aot_eager)", results[0])
    for result in results:
        assert mismatches(result) == []
