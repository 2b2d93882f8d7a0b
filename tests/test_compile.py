"""torch.compile composes with every parallel layout: each ViT and decoder block compiled with
fullgraph=True (the default, compile.fullgraph), so a graph break anywhere in a block, the
decoder's attention included, is an error and fails the run. Each test is one optimizer step of
the compiled parallel trainer against one eager process (same tolerances as test_parity.py;
test_parity.py::test_torch_compile_with_cp_matches_single_process is ring attention with FSDP).
The layouts below cover every cp_comm_type, full and selective activation checkpointing, FSDP,
TP with SP, TP with activation checkpointing, TP ranks whose ViT gets no image, and no CP. They
compile with "aot_eager" (dynamo and AOT autograd trace each block into one forward and one
backward graph, exactly what inductor receives, so a graph break or an untraceable op fails them
just the same); one layout, the richest, runs inductor instead, whose generated C++ kernels cost
about a minute to compile on the CPU. test_compiled_tp_recompiles_match_eager trains TP over
five steps whose batches change shape, so the blocks recompile with dynamic sizes, against the
same steps eager.

The whole parity suite compiled (every case of test_parity.py, test_packing.py,
test_vision_placement.py, test_tensor_parallel.py with compiled blocks):

    python -m pytest tests/test_parity.py tests/test_packing.py tests/test_vision_placement.py \
        tests/test_tensor_parallel.py --compile-backend aot_eager   # or inductor
"""

import pytest
from test_parity import mismatches, report

from titan_vlm.config import JobConfig

LAYOUTS = {
    # packed rows (samples with 0, 1 and 3 images, one mid-text), FSDP over cp, every block
    # recomputed in backward (the ring's collectives rerun inside the recomputation)
    "p2p_cp2_full_ac_packed": dict(
        comm="p2p", cp=2, ac="full", rows="mixed", seq_len=128, batch_size=2
    ),
    # bidirectional images: local plans with a causal and a dense varlen call
    "allgather_cp2_selective_ac_bidirectional": dict(
        comm="allgather",
        cp=2,
        ac="selective",
        rows="mixed",
        seq_len=128,
        image_attention="bidirectional",
    ),
    # 1 K/V head per tp rank does not split over cp = 2: all-to-all expands it; TP blocks with SP
    # inside the checkpoint wrapper (compiled first, then wrapped: parallelize_vlm), the tower
    # replicated. (Two layouts until 2026-12: a2a with SP, and p2p with SP, selective AC and the
    # tower replicated, 13 and 16 s; p2p's exchange compiled with TP is p2p_cp2xtp2_one_image.)
    "a2a_cp2xtp2_sp_selective_ac_replicate": dict(
        comm="a2a", cp=2, tp=2, sp=True, ac="selective", vision="replicate"
    ),
    # no CP: the local attention op, with TP and SP
    "local_tp2_sp": dict(cp=1, tp=2, sp=True, seq_len=80),
    "allgather_cp2xtp2_full_ac": dict(comm="allgather", cp=2, tp=2, ac="full"),
    # a rank whose TP ViT gets no image: cp rank 1 of one one-image row, and a text-only batch
    # (context_parallel.encode_images_never_empty)
    "p2p_cp2xtp2_one_image": dict(comm="p2p", cp=2, tp=2, batch_size=1),
    "local_tp2_sp_text_only": dict(cp=1, tp=2, sp=True, images=0, seq_len=80),
}


def test_compiled_blocks_are_one_graph_by_default():
    assert JobConfig().compile.fullgraph


# The richest layout goes through inductor (whose first stages are aot_eager's: dynamo, AOT
# autograd), the others through aot_eager.
INDUCTOR_LAYOUT = "p2p_cp2_full_ac_packed"
BACKENDS = {name: "inductor" if name == INDUCTOR_LAYOUT else "aot_eager" for name in LAYOUTS}
CASES = {f"{name}-{BACKENDS[name]}": (layout, BACKENDS[name]) for name, layout in LAYOUTS.items()}


@pytest.mark.parametrize("layout, backend", CASES.values(), ids=CASES.keys())
def test_compiled_one_step_matches_single_process(pool, layout, backend):
    results = pool.run("parity", compile_backend=backend, **layout)
    report(f"compiled ({backend}) {layout}", results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"


# Packed rows with up to 3 images per sample. Steps 1-5 have 4, 2, 2, 3, 2 images (the ViT
# block's batch) and decoder sequences of 80, 80, 80, 96, 68 slots: each block sees three
# shapes, none of them a size 1 (which dynamo would specialize). TP without SP: the layout whose
# recompile died (with SP the decoder's backward takes another path and never hit it).
VARYING = dict(
    training__seq_len=80,
    training__local_batch_size=2,
    training__warmup_steps=2,
    data__packing=True,
    data__images_per_sample=3,
    data__sentences_per_image=3,
    metrics__enable_tensorboard=False,
)


def test_compiled_tp_recompiles_match_eager(pool, tmp_path):
    """TP, compiled, over steps whose batches change shape: a new shape recompiles the block
    with dynamic sizes (with DTensors in the block this recompile used to die in
    proxy_tensor._compute_proxy: parallelize.keep_first_symbol_proxy), a few graphs per block
    cover every batch, none breaks, and the losses match the eager run step by step."""
    steps = 5
    eager = pool.run(
        "train_run",
        dp_shard=1,
        cp=1,
        tp=2,
        steps=steps,
        job__dump_folder=str(tmp_path / "e"),
        **VARYING,
    )[0]
    compiled = pool.run(
        "compiled_train_run",
        dp_shard=1,
        cp=1,
        tp=2,
        steps=steps,
        compile__backend="aot_eager",
        job__dump_folder=str(tmp_path / "c"),
        **VARYING,
    )
    for result in compiled:
        assert result["graph_breaks"] == 0
        assert min(len(shapes) for shapes in result["shapes"].values()) >= 3, result["shapes"]
        # Each block: its static graph, then dynamic ones (automatic_dynamic_shapes makes a size
        # dynamic once it has changed) that serve every later batch. The decoder: one dynamic
        # graph. The ViT: two, as DTensor's view rule (the TP linear's flatten of [images,
        # tokens, dim], distributed/tensor/_ops/_view_ops.py) guards whether the image count is
        # even: 2 images recompile it dynamic, step 4's 3 once more, for every odd count.
        assert result["graphs"] == {"vit": 3, "decoder": 2}, result["graphs"]
        got = [h["loss"] for h in result["history"]]
        want = [h["loss"] for h in eager]
        assert got == pytest.approx(want, rel=1e-5), (got, want)
