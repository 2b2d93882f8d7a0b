"""Pipeline parallelism (parallel/pipeline.py): the debug model cut into stages over 2 ranks
trains as one process does, over several optimizer steps, by every schedule: the same losses,
gradient norms, per-parameter gradients and parameters (fp32), on packed rows with images whose
microbatches hold unequal loss tokens; each parameter on one stage, under its one-process name.
Negative control: each microbatch's loss over its own tokens (a mean of means) fails."""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_folders import save_qwen, save_qwen3
from test_parity import GRAD_TOL, PARAM_TOL
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

from titan_vlm.checkpoint import main as export_main
from titan_vlm.config import load_config
from titan_vlm.errors import ConfigError
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.models.llava.flops import layout_cost
from titan_vlm.parallel.pipeline import (
    StagePlan,
    balanced_split,
    bubble,
    check_schedule,
    split_layers,
    stage_split,
)
from titan_vlm.validate import validate_job

TOL = 1e-5
# Under CP, the suite's CP bounds (tests/test_parity.py), the same ones:
# - PARAM_TOL, the parameters after the AdamW steps: its first step is about lr * sign(g), so
#   gradient elements near zero turn their rounding into whole-lr differences; CP orders the sums
#   differently (measured 1.6e-5 for the ViT at pp = 2 x cp = 2);
# - GRAD_TOL, each parameter's gradient: the ring's partial sums round differently with each CPU's
#   kernels (the decoder's measured 1.24e-5 at pp = 2 x cp = 2, Interleaved1F1B, p2p, on a Xeon
#   with AVX512-FP16; under 1e-5 on others).


# every schedule, with the stages a rank it runs and enough debug-model layers for the stages
EVERY_SCHEDULE = [
    ("1F1B", 1, 3),
    ("GPipe", 1, 3),
    ("Interleaved1F1B", 2, 4),
    ("InterleavedZeroBubble", 1, 3),
    ("InterleavedZeroBubble", 2, 4),
]


def assert_one_process(out: list[dict], param_tol: float = TOL, grad_tol: float = TOL) -> None:
    for o in out:
        assert o["losses"] == pytest.approx(o["ref_losses"], rel=TOL, abs=1e-6), o
        assert o["grad_norms"] == pytest.approx(o["ref_grad_norms"], rel=TOL), o
        assert not o["missing_grads"], o["missing_grads"]
        assert max(o["grad_err"].values()) < grad_tol, o["grad_err"]
        assert max(o["param_err"].values()) < param_tol, o["param_err"]
        assert o["zero_grad_abs"] < 1e-8


def test_split_layers_are_even_with_the_first_stages_lighter():
    assert split_layers(3, 2) == [range(0, 1), range(1, 3)]
    assert split_layers(4, 4) == [range(k, k + 1) for k in range(4)]
    assert split_layers(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    with pytest.raises(ValueError, match="3 decoder layers cannot make 4 pipeline stages"):
        split_layers(3, 4)
    assert StagePlan(1, 2, 1, 3).stages == [1]
    assert StagePlan(1, 2, 2, 4).stages == [1, 3]
    assert StagePlan(0, 2, 1, 3).describe() == (
        "stage 0 (rank 0): vision, projector, embeddings, layers 0-0; "
        "stage 1 (rank 1): layers 1-2, norm, head"
    )


def test_the_layers_are_split_by_the_cost_model_or_as_set():
    """balanced_split: the costliest stage as cheap as can be, a layer costing 1, the first
    stage's ViT and the last's head on top; the most even among those; with no extra cost it is
    split_layers. stage_split: the config's pipeline_parallel_stage_layers where set, else the
    cost model's for the config's rows (the debug model's head, 264 x 128, costs more of a layer
    than its ViT on 3 images: the last stage gets fewer layers)."""
    for n, stages in ((3, 2), (4, 4), (7, 3), (32, 8)):
        assert balanced_split(n, stages, 0.0, 0.0) == split_layers(n, stages)
    assert [len(r) for r in balanced_split(8, 4, 2.0, 0.0)] == [1, 2, 2, 3]
    assert [len(r) for r in balanced_split(8, 4, 0.0, 1.5)] == [2, 2, 3, 1]
    assert [len(r) for r in balanced_split(6, 2, 0.4, 0.0)] == [3, 3]  # 3.4 < 4
    cfg = load_config(
        ["--config", "train_configs/vlm_cp.toml", "--parallelism.pipeline_parallel_degree=2"]
    )
    args = get_flavor("debug")
    cost = layout_cost(args)
    assert stage_split(cfg, 2, cost, args.decoder) == [range(0, 2), range(2, 3)]
    cfg.parallelism.pipeline_parallel_stage_layers = "1,2"
    assert stage_split(cfg, 2, cost, args.decoder) == [range(0, 1), range(1, 3)]


def test_the_modelled_bubble():
    assert bubble("1F1B", 2, 1, 4) == pytest.approx(1 / 5)
    assert bubble("Interleaved1F1B", 4, 2, 4) == pytest.approx(1 / 9)
    assert bubble("InterleavedZeroBubble", 2, 1, 4) == pytest.approx(1 / 13)  # a third of it


@pytest.mark.parametrize(
    "args, message",
    [
        (("1F1B", 4, 1, 2), "needs at least 4 microbatches a step"),
        (("Interleaved1F1B", 2, 1, 4), "set parallelism.pipeline_parallel_stages_per_rank >= 2"),
        (("GPipe", 2, 2, 4), "runs one stage a rank"),
        (("Interleaved1F1B", 2, 2, 3), "3 microbatches a step do not divide into rounds of 2"),
        (("InterleavedZeroBubble", 2, 1, 3), "3 microbatches a step do not divide into rounds"),
    ],
)
def test_schedules_that_cannot_run_are_one_line(args, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(*args)
    check_schedule("GPipe", 4, 1, 2)  # GPipe runs any count


@pytest.mark.parametrize("schedule, virtual, n_layers", EVERY_SCHEDULE)
def test_two_stage_ranks_train_as_one_process(pool, schedule, virtual, n_layers):
    out = pool.run("pp_parity", pp=2, schedule=schedule, virtual=virtual, n_layers=n_layers)
    assert_one_process(out)
    assert len(set(out[0]["microbatch_tokens"])) > 1  # the normaliser matters
    names = [set(o["names"]) for o in out]
    assert not names[0] & names[1]  # each parameter on one stage
    assert any(n.startswith("vision.") for n in names[0])
    assert not any(n.startswith("vision.") for n in names[1])
    assert "decoder.output.weight" in names[1] and "decoder.output.weight" not in names[0]


@pytest.mark.parametrize("schedule, virtual, n_layers", [("1F1B", 1, 3), ("Interleaved1F1B", 2, 4)])
def test_stages_sharded_over_two_dp_ranks_train_as_one_process(pool, schedule, virtual, n_layers):
    """pp = 2 x dp_shard = 2 on 4 ranks: each stage's units FSDP-sharded over the 2 dp ranks,
    which read their own rows of the global batch; the whole gradient of each parameter (its
    shards gathered) and the parameters after the steps are one process's."""
    out = pool.run(
        "pp_parity", pp=2, dp_shard=2, schedule=schedule, virtual=virtual, n_layers=n_layers
    )
    assert len(out) == 4
    assert_one_process(out)
    assert [set(o["names"]) for o in out[:2]] != [set(o["names"]) for o in out[2:]]


@pytest.mark.parametrize(
    "schedule, virtual, n_layers, cp_options, rows",
    [
        ("Interleaved1F1B", 2, 4, {"comm_type": "p2p"}, 1),
        (
            "1F1B",
            1,
            3,
            {"comm_type": "allgather", "vision": "broadcast", "sample_placement": "split"},
            2,
        ),
        ("1F1B", 1, 3, {"comm_type": "a2a", "vision": "replicate"}, 1),
    ],
)
def test_stages_over_two_cp_ranks_train_as_one_process(
    pool, schedule, virtual, n_layers, cp_options, rows
):
    """pp = 2 x cp = 2 on 4 ranks: each (stage, cp rank) sends its cp rank's hidden states to the
    next stage's rank of the same cp rank; every stage's attention is exact over its cp ranks (each
    comm type), stage 0's image embeddings whole on both and their gradient summed over cp; the
    stages' units FSDP-sharded over cp. Loss and each parameter's gradient are one process's.
    With `rows` = 2 a microbatch, its samples split head-tail (cp_sample_placement = "split"):
    the image prefix of one row and the text of another cross stages (wire_slots)."""
    out = pool.run(
        "pp_parity",
        pp=2,
        cp=2,
        schedule=schedule,
        virtual=virtual,
        n_layers=n_layers,
        cp_options=cp_options,
        microbatches=4 // rows,
        rows_per_microbatch=rows,
    )
    assert len(out) == 4
    assert_one_process(out, PARAM_TOL, GRAD_TOL)


@pytest.mark.parametrize(
    "schedule, virtual, n_layers, sp, tie",
    [("1F1B", 1, 3, False, False), ("Interleaved1F1B", 2, 4, True, True)],
)
def test_stages_split_over_two_tp_ranks_train_as_one_process(
    pool, schedule, virtual, n_layers, sp, tie
):
    """pp = 2 x tp = 2 on 4 ranks: each stage's blocks, embeddings and head split over its tp
    ranks (with sequence parallelism each stage's run of blocks cut and gathered on its own, so
    the hidden states cross stages whole, from each tp rank to the next stage's same tp rank;
    tied embeddings' two copies split alike); loss and each parameter's gradient are one
    process's."""
    out = pool.run(
        "pp_parity",
        pp=2,
        tp=2,
        sp=sp,
        tie=tie,
        schedule=schedule,
        virtual=virtual,
        n_layers=n_layers,
    )
    assert len(out) == 4
    # TP sums each row-wise product over its ranks in another order: AdamW's first step turns
    # that rounding into whole-lr differences of near-zero gradient elements (1.3e-5 of the
    # ViT's weights measured; the gradients themselves within 2e-6)
    assert_one_process(out, PARAM_TOL)


@pytest.mark.parametrize("schedule, virtual, n_layers", EVERY_SCHEDULE)
def test_a_mixture_of_experts_decoder_trains_as_one_process(pool, schedule, virtual, n_layers):
    """debug_moe's decoder (4 layers, 1 and 2 sparse, on different stages) at pp = 2: each stage
    adds its routers' statistics to the carrier that crosses stages with the hidden states, and
    the last stage's load-balancing loss sends its gradient back to every router: the loss,
    grad norm and every gradient of one process adding each microbatch's balance loss."""
    del n_layers  # 4: layers 0-1 and 2-3 a rank (one stage each), or one a stage
    out = pool.run("pp_parity", pp=2, moe=True, schedule=schedule, virtual=virtual, n_layers=4)
    assert_one_process(out)
    for o in out:  # a sparse layer on each rank
        assert sum(n.endswith("router.weight") for n in o["names"]) == 1
    if schedule == "1F1B":  # control: the first stage's router misses the balance gradient
        wrong = pool.run("pp_parity", pp=2, moe=True, n_layers=4, steps=1, carrier_detached=True)
        assert wrong[0]["grad_err"]["decoder"] > 100 * TOL


def test_image_grads_not_summed_over_cp_fail_the_pipeline_parity(pool):
    out = pool.run("pp_parity", pp=2, cp=2, image_grads_not_summed=True)
    first_stage = [o for o in out if any(n.startswith("vision.") for n in o["names"])]
    assert first_stage
    for o in first_stage:
        assert max(o["grad_err"]["vision"], o["grad_err"]["projector"]) > 1e-2


def test_a_mean_of_microbatch_means_fails_the_parity_sharded_too(pool):
    out = pool.run("pp_parity", pp=2, dp_shard=2, loss_over_each_microbatch=True)
    for o in out:
        assert o["losses"][0] != pytest.approx(o["ref_losses"][0], rel=1e-3)
        assert max(o["grad_err"].values()) > 1e-2


def test_rows_of_two_a_microbatch_cross_stages_padded(pool):
    """Microbatches of 2 rows: a local sequence up to twice a row (wire_slots)."""
    out = pool.run("pp_parity", pp=2, microbatches=2, rows_per_microbatch=2)
    assert_one_process(out)


@pytest.mark.parametrize("dp_shard", [1, 2])
def test_tied_embeddings_across_the_first_and_last_stages_train_as_one_process(pool, dp_shard):
    """The head tied to the token embeddings: the first stage holds the weight for the lookups,
    the last for the head, under the one name (decoder.tok_embeddings.weight); each copy's
    gradient is the sum of both uses, counted once in the norm, so both take one process's
    step (alone, and each stage sharded over 2 dp ranks). Negative control: each copy stepping
    with its own use's gradient."""
    out = pool.run("pp_parity", pp=2, dp_shard=dp_shard, tie=True)
    # sharded, the embedding's gradient sums in another order: its first step's gradients are
    # one process's to 2e-7, but AdamW's first step (about lr * sign(g)) turns the rounding of
    # its near-zero elements into whole-lr differences (2.7e-5 of the weight), which the second
    # step's gradients carry (1.6e-5, measured); the control misses by over 1e-2
    tol = PARAM_TOL if dp_shard > 1 else TOL
    assert_one_process(out, tol, tol)
    for o in out:
        assert "decoder.tok_embeddings.weight" in o["names"]
        assert "decoder.output.weight" not in o["names"]
    wrong = pool.run("pp_parity", pp=2, dp_shard=dp_shard, tie=True, tied_grads_not_summed=True)
    for o in wrong:
        assert o["grad_err"]["decoder"] > 1e-2


@pytest.mark.parametrize("dp_shard", [1, 2])
def test_bf16_stages_stay_within_bf16_rounding(pool, dp_shard):
    """bf16 mixed precision at pp = 2 (alone: FSDP's policy on one rank; and x dp_shard = 2):
    bf16 parameters, compute and hidden states between stages, fp32 gradients, against the fp32
    process, within test_parity.py's bf16 bounds (measured: loss 3e-5, gradients 1.6e-2)."""
    out = pool.run("pp_parity", pp=2, dp_shard=dp_shard, steps=1, mixed_precision="bf16")
    for o in out:
        assert abs(o["losses"][0] - o["ref_losses"][0]) / o["ref_losses"][0] < 1e-3, o
        assert max(o["grad_err"].values()) < 3e-2, o["grad_err"]
        assert max(o["grad_err"].values()) > 1e-5  # it did compute in bf16


def test_the_trainer_in_bf16_at_pp_2_follows_its_curve_without_stages(pool, tmp_path):
    """The real loop in bf16 (the hidden states between stages bf16): the losses of the bf16
    run without stages, to bf16's rounding (measured 8e-4 at step 4)."""
    run = dict(RUN, training__mixed_precision="bf16")
    one = losses(pool.run("train_run", dp_shard=1, cp=1, job__dump_folder=str(tmp_path), **run)[0])
    staged = pool.run(
        "train_run", dp_shard=1, cp=1, pp=2, job__dump_folder=str(tmp_path / "pp"), **run
    )
    assert losses(staged[0]) == pytest.approx(one, rel=3e-3)


def test_a_mean_of_microbatch_means_fails_the_parity(pool):
    out = pool.run("pp_parity", pp=2, loss_over_each_microbatch=True)
    for o in out:
        assert o["losses"][0] != pytest.approx(o["ref_losses"][0], rel=1e-3)
        assert max(o["grad_err"].values()) > 1e-2


# The trainer (real loop, checkpoints) with parallelism.pipeline_parallel_degree = 2.
RUN = dict(
    steps=4,
    training__seq_len=61,
    training__local_batch_size=4,
    training__warmup_steps=1,
    metrics__enable_tensorboard=False,
    data__num_workers=0,
)


def losses(history: list[dict]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history}


@pytest.mark.parametrize(
    "schedule, dp, cp", [("1F1B", 1, 1), ("GPipe", 1, 1), ("1F1B", 2, 1), ("1F1B", 1, 2)]
)
def test_the_trainer_at_pp_2_trains_the_one_process_curve_and_resumes_at_pp_1(
    pool, tmp_path, schedule, dp, cp
):
    """The real loop at pp = 2 (4 microbatches of 1 row a step), with dp = 2 each stage sharded
    over 2 dp ranks, with cp = 2 each stage's attention over 2 cp ranks (4 ranks), against the
    same dp and cp without stages (which the parity tests tie to one process): the same losses
    and grad norms, on every rank; its step-2 checkpoint resumed without stages (the run died
    after step 3) continues the curve."""
    one = losses(
        pool.run("train_run", dp_shard=dp, cp=cp, job__dump_folder=str(tmp_path), **RUN)[0]
    )
    ckpt = dict(
        checkpoint__enable=True,
        checkpoint__interval=2,
        job__dump_folder=str(tmp_path / "pp"),
        parallelism__pipeline_parallel_schedule=schedule,
        # the layers as set (the others: the cost model's split, 2 and 1)
        parallelism__pipeline_parallel_stage_layers="1,2" if schedule == "GPipe" else "",
        **RUN,
    )
    staged = pool.run("train_run", dp_shard=dp, cp=cp, pp=2, stop_after=3, **ckpt)
    assert len(staged) == 2 * dp * cp
    assert all(losses(s) == losses(staged[0]) for s in staged)  # every rank has the loss
    assert sorted(losses(staged[0])) == [1, 2, 3]
    for step, loss in losses(staged[0]).items():
        assert loss == pytest.approx(one[step], rel=TOL), (step, loss, one[step])
    ckpt.pop("parallelism__pipeline_parallel_stage_layers")  # no stages to split
    resumed = losses(pool.run("train_run", dp_shard=dp, cp=cp, **ckpt)[0])
    assert sorted(resumed) == [3, 4]
    for step, loss in resumed.items():
        assert loss == pytest.approx(one[step], rel=TOL), (step, loss, one[step])


def test_the_trainer_at_pp_2_x_tp_2_follows_tp_2_and_resumes_at_pp_1(pool, tmp_path):
    """The real loop at pp = 2 x tp = 2 (sequence parallel, the config's default) on 4 ranks: the
    losses of tp = 2 without stages; its step-2 checkpoint resumed at pp = 1, tp = 1 continues
    the curve."""
    one = losses(
        pool.run("train_run", dp_shard=1, cp=1, tp=2, job__dump_folder=str(tmp_path), **RUN)[0]
    )
    ckpt = dict(
        checkpoint__enable=True,
        checkpoint__interval=2,
        job__dump_folder=str(tmp_path / "pp"),
        **RUN,
    )
    staged = pool.run("train_run", dp_shard=1, cp=1, tp=2, pp=2, stop_after=3, **ckpt)
    assert len(staged) == 4
    for s in staged:
        assert losses(s) == pytest.approx({k: one[k] for k in (1, 2, 3)}, rel=TOL)
    resumed = losses(pool.run("train_run", dp_shard=1, cp=1, **ckpt)[0])
    assert resumed == pytest.approx({k: one[k] for k in (3, 4)}, rel=TOL)


@pytest.mark.parametrize("schedule, virtual, n_layers", EVERY_SCHEDULE)
def test_every_schedule_evaluates_forward_only_between_steps(pool, schedule, virtual, n_layers):
    """Pipeline.evaluate (torch's schedule.eval) before and after a training step, and the step
    between them: one process's summed loss each time (the schedule switches to forward only
    and back)."""
    for o in pool.run("pp_eval", schedule=schedule, virtual=virtual, n_layers=n_layers):
        assert o["evals"] == pytest.approx(o["ref_evals"], rel=TOL)
        assert o["loss"] == pytest.approx(o["ref_loss"], rel=TOL)
        assert o["evals"][1] < o["evals"][0]  # the step between them counted


@pytest.mark.parametrize("schedule, cp", [("1F1B", 1), ("GPipe", 1), ("1F1B", 2)])
def test_validation_runs_the_stages_forward_only(pool, tmp_path, schedule, cp):
    """validation.enable at pp = 2 (the schedule's forward alone, torch's schedule.eval, between
    training steps; with cp = 2 each stage's attention over its cp ranks): the validation losses
    and the training losses after them are those of the run without stages, on every rank."""
    plain = dict(RUN, validation__enable=True, validation__freq=2, validation__steps=2)
    run = dict(plain, parallelism__pipeline_parallel_schedule=schedule)
    one = pool.run("train_run", dp_shard=1, cp=cp, job__dump_folder=str(tmp_path / "a"), **plain)[0]
    staged = pool.run(
        "train_run", dp_shard=1, cp=cp, pp=2, job__dump_folder=str(tmp_path / "b"), **run
    )
    want = {h["step"]: h["validation_loss"] for h in one if "validation_loss" in h}
    assert sorted(want) == [2, 4]
    for out in staged:
        got = {h["step"]: h["validation_loss"] for h in out if "validation_loss" in h}
        assert got == pytest.approx(want, rel=TOL)
        assert losses(out) == pytest.approx(losses(one), rel=TOL)


@pytest.mark.parametrize("dp, cp, ep", [(1, 1, 1), (1, 2, 1), (2, 1, 2)])
def test_the_trainer_with_experts_at_pp_2_follows_its_accumulation_without_stages(
    pool, tmp_path, dp, cp, ep
):
    """debug_moe at pp = 2 (4 microbatches of 1 row a step a dp rank; with cp = 2 the balance
    loss over both cp ranks' tokens; with dp_shard = 2 x ep = 2 each stage's experts split over
    its 2 dp ranks, their tokens exchanged within the stage): the losses, grad norms and expert
    load metrics (moe_aux_loss, moe_load_max) of the same layout without stages accumulating
    the same rows one at a time (each microstep's balance loss as each microbatch's), on every
    rank."""
    run = dict(
        RUN,
        model__flavor="debug_moe",
        training__local_batch_size=1,
        training__global_batch_size=4 * dp,
    )
    mesh = dict(dp_shard=dp, cp=cp, ep=ep)
    one = pool.run("train_run", job__dump_folder=str(tmp_path / "a"), **mesh, **run)[0]
    staged = pool.run("train_run", pp=2, job__dump_folder=str(tmp_path / "b"), **mesh, **run)
    keys = ("loss", "grad_norm", "moe_aux_loss", "moe_load_max")
    for out in staged:
        for got, want in zip(out, one, strict=True):
            for key in keys:
                assert got[key] == pytest.approx(want[key], rel=TOL), (key, got[key], want[key])


def test_experts_in_microbatches_smaller_than_a_microstep_are_warned_of(pool, tmp_path):
    """debug_moe at pp = 2 in microbatches of 1 row, 2 rows a microstep: the load-balancing loss
    is each microbatch's, which the run without stages computes over 2 rows: a warning says so
    and what to set; microbatches of 2 rows: none."""
    run = dict(RUN, model__flavor="debug_moe", steps=1, training__local_batch_size=2)
    for size, warned in ((1, True), (2, False)):
        out = pool.run(
            "train_run_warnings",
            dp_shard=1,
            cp=1,
            pp=2,
            parallelism__pipeline_parallel_schedule="GPipe",
            parallelism__pipeline_parallel_microbatch_size=size,
            job__dump_folder=str(tmp_path / str(size)),
            **run,
        )
        for o in out:
            said = [w for w in o["warnings"] if "load-balancing loss is each microbatch's" in w]
            assert bool(said) == warned, o["warnings"]
            if warned:
                assert "parallelism.pipeline_parallel_microbatch_size=2" in said[0]


def test_the_trainer_at_pp_2_x_hsdp_follows_hsdp_without_stages(pool, tmp_path):
    """pp = 2 x dp_replicate = 2 (HSDP: each stage's units replicated over the 2 replicas, their
    gradients all-reduced; 4 ranks): the losses and grad norms of dp_replicate = 2 without
    stages, on every rank."""
    rows = dict(RUN, training__local_batch_size=2)
    one = pool.run(
        "train_run", dp_shard=1, cp=1, dp_replicate=2, job__dump_folder=str(tmp_path), **rows
    )[0]
    staged = pool.run(
        "train_run",
        dp_shard=1,
        cp=1,
        dp_replicate=2,
        pp=2,
        job__dump_folder=str(tmp_path / "pp"),
        **rows,
    )
    assert len(staged) == 4
    for out in staged:
        for got, want in zip(out, one, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=TOL)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)


def test_a_checkpoint_resumes_at_another_pipeline_layout(pool, tmp_path):
    """A pp = 2 run's step-2 checkpoint resumed at pp = 2 and at pp = 2 x dp_shard = 2 (each
    stage sharded), and a one-process checkpoint resumed at pp = 2: each continues the
    one-process curve (the model, the optimizer state and the schedule)."""
    one = losses(pool.run("train_run", dp_shard=1, cp=1, job__dump_folder=str(tmp_path), **RUN)[0])
    save = dict(checkpoint__enable=True, checkpoint__interval=2, **RUN)
    for name, pp in (("pp", 2), ("one", 1)):
        pool.run(
            "train_run",
            dp_shard=1,
            cp=1,
            pp=pp,
            stop_after=3,
            job__dump_folder=str(tmp_path / name),
            **save,
        )
    for name, dp in (("pp", 1), ("one", 1), ("pp", 2)):
        folder = tmp_path / f"{name}-{dp}"
        shutil.copytree(tmp_path / name, folder)
        rows = {"training__local_batch_size": RUN["training__local_batch_size"] // dp}
        out = pool.run(
            "train_run", dp_shard=dp, cp=1, pp=2, job__dump_folder=str(folder), **{**save, **rows}
        )
        resumed = losses(out[0])
        assert sorted(resumed) == [3, 4], (name, dp)
        for step, loss in resumed.items():
            assert loss == pytest.approx(one[step], rel=TOL), (name, dp, step, loss, one[step])


@pytest.mark.parametrize(
    "family, cp, tie", [("qwen2_5_vl", 2, False), ("qwen3_vl", 1, False), ("qwen2_5_vl", 1, True)]
)
def test_qwen_folders_at_pp_2_train_the_curve_without_stages_and_export(
    pool, tmp_path, family, cp, tie
):
    """A folder transformers wrote (Qwen2.5-VL: M-RoPE positions per slot, at pp = 2 x cp = 2,
    and with its head tied to its embeddings, as Qwen2.5-VL-3B's; Qwen3-VL: its DeepStack
    features added after decoder layers 0 and 1, which the first stage holds) read at pp = 2,
    each rank its stages' tensors: the losses and grad norms of the same run without stages,
    and its checkpoint exports to a folder transformers loads with no missing or unexpected
    tensor, holding what the run without stages trained (to AdamW's rounding)."""
    folder = tmp_path / "hf"
    save, model_class = (
        (save_qwen, Qwen2_5_VLForConditionalGeneration)
        if family == "qwen2_5_vl"
        else (save_qwen3, Qwen3VLForConditionalGeneration)
    )
    save(folder, tie=tie)
    run = dict(
        RUN,
        model__flavor="hf",
        model__hf_path=str(folder),
        checkpoint__enable=True,
        checkpoint__interval=RUN["steps"],
    )
    runs = {}
    for name, pp in (("one", 1), ("pp", 2)):
        out = pool.run(
            "train_run", dp_shard=1, cp=cp, pp=pp, job__dump_folder=str(tmp_path / name), **run
        )
        assert all(losses(h) == losses(out[0]) for h in out)  # every rank has the losses
        runs[name] = out[0]
    assert losses(runs["pp"]) == pytest.approx(losses(runs["one"]), rel=TOL)
    norms = [[h["grad_norm"] for h in runs[name]] for name in ("pp", "one")]
    assert norms[0] == pytest.approx(norms[1], rel=TOL)
    exported = {}
    for name in ("one", "pp"):
        export_main(
            [
                "--export-hf",
                str(tmp_path / name / "copy0" / "checkpoint"),
                str(tmp_path / f"{name}-hf"),
            ]
        )
        hf, info = model_class.from_pretrained(tmp_path / f"{name}-hf", output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
        exported[name] = dict(hf.named_parameters())
    source = dict(model_class.from_pretrained(folder).named_parameters())
    assert exported["pp"].keys() == exported["one"].keys()
    for key, theirs in exported["pp"].items():
        want = exported["one"][key]
        assert (theirs - want).norm() <= PARAM_TOL * want.norm(), key
    trained = [k for k in source if not torch.equal(source[k], exported["pp"][k])]
    assert len(trained) > len(source) // 2  # it trained
    if tie:  # one weight, as the source's
        assert "lm_head.weight" not in exported["pp"]
        assert "model.language_model.embed_tokens.weight" in trained


def test_tied_embeddings_resume_across_pipeline_layouts(pool, tmp_path):
    """A tied head's weight has the one name on both stages, in the model and the optimizer
    state: a pp = 2 run's step-2 checkpoint (alone, and each stage sharded over 2 dp ranks)
    resumes without stages, and a one-process run's at pp = 2, each continuing the one-process
    curve."""
    folder = tmp_path / "hf"
    save_qwen(folder, tie=True)
    run = dict(RUN, model__flavor="hf", model__hf_path=str(folder))
    one = losses(pool.run("train_run", dp_shard=1, cp=1, job__dump_folder=str(tmp_path), **run)[0])
    for name, pp, then, dp in (("pp", 2, 1, 1), ("one", 1, 2, 1), ("pp-dp", 2, 1, 2)):
        save = dict(
            run,
            checkpoint__enable=True,
            checkpoint__interval=2,
            training__local_batch_size=RUN["training__local_batch_size"] // dp,
            job__dump_folder=str(tmp_path / name),
        )
        pool.run("train_run", dp_shard=dp, cp=1, pp=pp, stop_after=3, **save)
        resumed = losses(pool.run("train_run", dp_shard=dp, cp=1, pp=then, **save)[0])
        assert sorted(resumed) == [3, 4], name
        for step, loss in resumed.items():
            assert loss == pytest.approx(one[step], rel=TOL), (name, step, loss, one[step])


def test_stages_compiled_and_checkpointed_train_the_one_process_curve(pool, tmp_path):
    """Compile (every block of a stage, fullgraph: no graph break) and full activation
    checkpointing of each stage's blocks at pp = 2: the losses of the eager run without them,
    each rank compiling and wrapping its own stages' blocks only."""
    eager = losses(
        pool.run("train_run", dp_shard=1, cp=1, job__dump_folder=str(tmp_path / "e"), **RUN)[0]
    )
    out = pool.run(
        "staged_compiled_run",
        dp_shard=1,
        cp=1,
        pp=2,
        compile__backend="aot_eager",
        activation_checkpoint__mode="full",
        job__dump_folder=str(tmp_path / "c"),
        **RUN,
    )
    # the debug model split 2 | 1 (the cost model): the ViT's 2 blocks and decoder layers 0-1
    # on the first rank, layer 2 on the second
    assert [(o["compiled"], o["checkpointed"]) for o in out] == [(4, 4), (1, 1)]
    for o in out:
        assert o["graph_breaks"] == 0
        assert losses(o["history"]) == pytest.approx(eager, rel=TOL)


def test_initial_weights_load_into_the_stages(pool, tmp_path):
    """checkpoint.initial_load_path at pp = 2: each rank reads its stages' weights of a
    one-process run's checkpoint, and the run follows the one-process run from the same
    weights; the checkpoint's names are checked against the whole model (every rank's)."""
    save = dict(RUN, checkpoint__enable=True, checkpoint__interval=2)
    pool.run(
        "train_run", dp_shard=1, cp=1, stop_after=2, job__dump_folder=str(tmp_path / "a"), **save
    )
    start = dict(RUN, checkpoint__initial_load_path=str(tmp_path / "a" / "copy0" / "checkpoint"))
    one = losses(
        pool.run("train_run", dp_shard=1, cp=1, job__dump_folder=str(tmp_path / "b"), **start)[0]
    )
    staged = pool.run(
        "train_run", dp_shard=1, cp=1, pp=2, job__dump_folder=str(tmp_path / "c"), **start
    )
    fresh = losses(
        pool.run("train_run", dp_shard=1, cp=1, job__dump_folder=str(tmp_path / "d"), **RUN)[0]
    )
    assert losses(staged[0]) == pytest.approx(one, rel=TOL)
    assert losses(staged[0])[1] < fresh[1] - 0.1  # it started from the trained weights


@pytest.mark.parametrize(
    "keys, world, message",
    [
        (
            ["--validation.enable=true", "--training.global_batch_size=8"],
            2,
            "with validation.enable and 2 accumulation steps: not yet",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule=InterleavedZeroBubble",
                "--parallelism.data_parallel_shard_degree=2",
            ],
            4,
            "'InterleavedZeroBubble' with data, context or tensor parallelism: not yet",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule=InterleavedZeroBubble",
                "--parallelism.context_parallel_degree=2",
            ],
            4,
            "'InterleavedZeroBubble' with data, context or tensor parallelism: not yet",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule=InterleavedZeroBubble",
                "--training.mixed_precision=bf16",
            ],
            2,
            "'InterleavedZeroBubble' with training.mixed_precision='bf16': not yet",
        ),
        (
            ["--model.name=qwen3_vl", "--parallelism.pipeline_parallel_stage_layers=1,2"],
            2,
            "the first stage must hold the decoder's first 2 layers",
        ),
        (["--training.local_batch_size=1"], 2, "needs at least 2 microbatches a step"),
        (["--parallelism.pipeline_parallel_microbatch_size=3"], 2, "does not divide the 4 rows"),
        (
            ["--parallelism.pipeline_parallel_schedule=Interleaved1F1B"],
            2,
            "set parallelism.pipeline_parallel_stages_per_rank >= 2",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                "--parallelism.pipeline_parallel_stages_per_rank=2",
            ],
            2,
            "3 decoder layers cannot make 4 pipeline stages",
        ),
        (
            ["--parallelism.pipeline_parallel_stage_layers=1,1"],
            2,
            "needs 2 counts .* summing to the decoder's 3 layers",
        ),
        (
            ["--parallelism.pipeline_parallel_stage_layers=1;2"],
            2,
            "expected comma-separated layer counts",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree=1",
                "--parallelism.pipeline_parallel_stage_layers=1,2",
            ],
            1,
            "stage_layers='1,2' without pipeline parallelism",
        ),
    ],
)
def test_what_the_pipeline_does_not_run_is_one_line(keys, world, message):
    cfg = load_config(
        ["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4", *keys]
    )
    with pytest.raises(ConfigError, match=message) as e:
        validate_job(cfg, world)
    assert "\n" not in str(e.value) and str(e.value).startswith("parallelism.pipeline_parallel")


def test_a_pipeline_config_validates():
    cfg = load_config(["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4"])
    assert validate_job(cfg, 2).pp == 2
    sharded = load_config(
        [
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.data_parallel_shard_degree=2",
            "--training.local_batch_size=4",
        ]
    )
    assert validate_job(sharded, 4).dp_shard == 2  # each stage sharded over 2 dp ranks
    every_family = [
        "--parallelism.pipeline_parallel_degree=2",
        "--training.local_batch_size=4",
        "--compile.enable=true",
        "--activation_checkpoint.mode=full",
    ]
    for name in ("llava", "qwen2_5_vl", "qwen3_vl"):
        assert validate_job(load_config([*every_family, f"--model.name={name}"]), 2).pp == 2
    experts = [
        "--model.flavor=debug_moe",
        "--parallelism.data_parallel_shard_degree=2",
        "--parallelism.expert_parallel_degree=2",
    ]
    assert validate_job(load_config([*every_family, *experts]), 4).ep == 2
