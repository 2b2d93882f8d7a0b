"""Packed rows under context parallelism reproduce one process.

Rows hold several samples; each sample's images sit anywhere in its text (start, middle, end,
interleaved); attention stays inside a sample; the image slots are whole on every CP rank and
only the text is split (head-tail per sample). Tolerances as in test_parity.py."""

import pytest
from test_parity import COMM_TYPES, mismatches, report

SEQ_LEN = 128  # the hand-built rows of dist_checks.special_rows fit in 128 slots


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_packed_rows_with_0_1_and_3_images_match_single_process(pool, comm, cp):
    """Samples with 0, 1 and 3 images, an image in the middle and one at the end of the text."""
    results = pool.run("parity", comm=comm, cp=cp, rows="mixed", seq_len=SEQ_LEN, batch_size=2)
    report(f"packed mixed {comm} cp={cp}", results[0])
    for rank, result in enumerate(results):
        assert mismatches(result) == [], f"rank {rank}: {mismatches(result)}"


# bidirectional images, packed "mixed" rows, every cp_comm_type at cp 2 and 4:
# test_parity.py::test_bidirectional_image_attention_matches_single_process


@pytest.mark.parametrize("cp", [2, 4])
def test_images_all_among_one_ranks_text_match_single_process(pool, cp):
    results = pool.run(
        "parity", comm="p2p", cp=cp, rows="one_rank_images", seq_len=SEQ_LEN, batch_size=2
    )
    report(f"images inside one rank's chunk, cp={cp}", results[0])
    for result in results:
        assert mismatches(result) == []


@pytest.mark.parametrize("rows", ["no_image", "half_images"])
def test_rows_without_images_match_single_process(pool, rows):
    """dp_shard=2 x cp=2, one row per dp rank: with "half_images" one dp rank has no image at all
    and still enters every collective of the vision tower (FSDP), so nothing hangs."""
    results = pool.run(
        "parity", comm="p2p", dp_shard=2, cp=2, rows=rows, seq_len=SEQ_LEN, batch_size=1
    )
    report(f"{rows}, dp_shard=2 x cp=2", results[0])
    for result in results:
        assert mismatches(result) == []


@pytest.mark.parametrize("comm", COMM_TYPES)
def test_builtin_packed_data_matches_single_process(pool, comm):
    """The built-in packed workload (up to 3 images per sample), dp_shard=2 x cp=2."""
    results = pool.run(
        "parity", comm=comm, dp_shard=2, cp=2, packing=True, images=3, seq_len=160, batch_size=2
    )
    report(f"built-in packed {comm} dp_shard=2 x cp=2", results[0])
    for result in results:
        assert mismatches(result) == []
        assert 1.0 <= result["cp_balance"] <= 1.10


def test_negative_control_attention_across_samples_fails(pool):
    """Let the parallel run's samples see each other (one sample per row): the harness must
    report it, in the loss and in every group's gradient."""
    result = pool.run(
        "parity", comm="p2p", cp=2, rows="mixed", seq_len=SEQ_LEN, batch_size=2, merge_samples=True
    )[0]
    report("packed mixed, samples merged (negative control)", result)
    problems = mismatches(result)
    assert any(p.startswith("loss") for p in problems), problems
    assert any(p.startswith("decoder gradient") for p in problems), problems


def test_ranks_that_built_different_batches_stop_together(pool):
    """A data error on one CP rank only (its batch differs) is an error on every rank of the
    group at that step, not a hang in the next collective."""
    for message in pool.run("mismatched_batches", cp=2):
        assert message.startswith(
            "step 2: the CP/TP ranks that share rows built different batches"
        ), message
