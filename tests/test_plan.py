"""The planner (python -m titan_vlm.plan) against what runs here: its activation bytes against
the saved-for-backward bytes benchmarks/cp_scaling.py measures (within 1%: a 10% tolerance let
the custom op's extra saved inputs, 4-8% under allgather and a2a, pass unnoticed), its CP attention
bytes against the bytes cp_scaling counts on the wire (exact), its model state against the
trainer's own expression on real meshes (exact)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from titan_vlm.config import JobConfig
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.models.llava.flops import layout_cost
from titan_vlm.models.llava.shapes import plan_shapes
from titan_vlm.plan.__main__ import main as plan_main
from titan_vlm.plan.comm import cp_attention_bytes, ep_layer_bytes
from titan_vlm.plan.memory import activation_bytes, state_bytes
from titan_vlm.plan.spec import Layout, Workload

ROOT = Path(__file__).resolve().parents[1]
DEBUG = get_flavor("debug")
SHAPES = plan_shapes(DEBUG)
COMMS = ("p2p", "allgather", "a2a")


def cp_scaling_workload(seq_len: int, rows: int = 1, sentences: int | None = None) -> Workload:
    """The rows benchmarks/cp_scaling.py (sentences = seq_len // 8) and
    dist_checks.saved_for_backward (40) train on."""
    data = SyntheticCaptions(
        DEBUG.vision.image_size,
        DEBUG.tokens_per_image,
        seq_len,
        0,
        sentences_per_image=sentences or seq_len // 8,
    )
    batch = data.batch(0, 0, 1, rows)
    return Workload(batch.doc, batch.image)


def priced(layout: Layout, work: Workload) -> tuple[int, int]:
    """(activation bytes saved for backward under layout.ac_mode, CP attention bytes sent) per
    rank."""
    saved = sum(activation_bytes(SHAPES, layout, work, layout.ac_mode).values())
    return saved, cp_attention_bytes(SHAPES, layout, work)


def planned(cp: int, comm: str, work: Workload, ac: str = "none") -> tuple[int, int]:
    """`priced` with the cp_scaling worker's options (fp32, every sample split)."""
    return priced(Layout(cp=cp, cp_comm_type=comm, mixed_precision="fp32", ac_mode=ac), work)


def test_matches_the_recorded_cp_scaling_table_at_every_row():
    """docs/performance.md's table (4k to 32k slots, cp 1, 2, 4, every comm type)."""
    text = (ROOT / "docs/performance.md").read_text()
    rows = re.findall(
        r"^\| ([124]) \| (p2p|allgather|a2a|-) \| (\d+) \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \|",
        text,
        re.M,
    )
    assert len(rows) == 28
    for cp, comm, seq_len, saved_mib, sent_mib in rows:
        saved, sent = planned(
            int(cp), "p2p" if comm == "-" else comm, cp_scaling_workload(int(seq_len))
        )
        assert abs(saved / 2**20 / float(saved_mib) - 1) < 0.01, (cp, comm, seq_len)
        assert f"{sent / 2**20:.2f}" == sent_mib, (cp, comm, seq_len)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_matches_cp_scaling_measured_now(pool, cp):
    """benchmarks/cp_scaling.py's own worker, run here on cp processes: saved-for-backward
    within 1% of the plan, bytes sent equal to it (the worker reports MiB = bytes / 2**20,
    exact in a float)."""
    configs = [(comm, 1024) for comm in (COMMS if cp > 1 else ("p2p",))]
    for r in pool.run("cp_scaling_measured", cp=cp, configs=configs)[0]:
        comm = r["comm"] if cp > 1 else "p2p"
        saved, sent = planned(cp, comm, cp_scaling_workload(r["seq_len"]))
        measured = r["saved_mib"] * 2**20
        print(f"cp={cp} {comm} {r['seq_len']}: saved {measured:.0f}, planned {saved}")
        assert abs(saved / measured - 1) < 0.01
        assert sent == r["sent_mib"] * 2**20


@pytest.mark.parametrize("cp, seq_len, rows", [(2, 512, 2), (4, 1024, 1)])
def test_prices_the_trainers_placement_as_measured(pool, cp, seq_len, rows):
    """Packed rows (SyntheticCaptions' mix, up to 2 images a sample) under every cp_comm_type,
    placed as the trainer places them: every sample split with its images sharded, and "auto"
    (here some samples kept whole, one split with its images sharded): the plan's CP attention
    bytes equal the bytes sent, its saved-for-backward bytes within 3% of autograd's (the plan
    prices the rank with the most slots; the rank that saves most may hold one sample more).
    Negative control: priced as every sample split with replicated images (what the planner
    assumed before), the same rows send other bytes or save other activations."""
    for comm in COMMS:
        for placement, tokens in (("split", "shard"), ("auto", "auto")):
            r = pool.run(
                "placed_step_measured",
                cp=cp,
                comm=comm,
                placement=placement,
                image_tokens=tokens,
                seq_len=seq_len,
                rows=rows,
            )[0]
            assert r["sharded"] and r["split"] >= 1
            if placement == "auto":
                assert min(r["kept"]) >= 1, r["kept"]
            work = Workload(r["doc"], r["image"], cost=layout_cost(DEBUG))
            layout = Layout(
                cp=cp,
                cp_comm_type=comm,
                mixed_precision="fp32",
                cp_sample_placement=placement,
                cp_image_tokens=tokens,
            )
            saved, sent = priced(layout, work)
            print(f"cp={cp} {comm} {placement}/{tokens}: saved {r['saved']}, planned {saved}")
            assert sent == r["sent"], (comm, placement, sent, r["sent"])
            assert abs(saved / r["saved"] - 1) < 0.03, (comm, placement, saved, r["saved"])
            assumed = dataclasses.replace(
                layout, cp_sample_placement="split", cp_image_tokens="replicate"
            )
            assumed_saved, assumed_sent = priced(assumed, work)
            assert assumed_sent != r["sent"] or abs(assumed_saved / r["saved"] - 1) >= 0.03, (
                comm,
                placement,
            )


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_activation_checkpointing_matches_what_autograd_saves(pool, ac):
    """With AC, autograd keeps the blocks outside the checkpoints and each checkpoint's input."""
    for cp, comm in ((1, "p2p"), (2, "p2p"), (2, "a2a")):
        measured = max(
            r["bytes"] for r in pool.run("saved_for_backward", cp=cp, comm=comm, seq_len=528, ac=ac)
        )
        saved, _ = planned(cp, comm, cp_scaling_workload(528, sentences=40), ac)
        print(f"ac={ac} cp={cp} {comm}: saved {measured}, planned {saved}")
        assert abs(saved / measured - 1) < 0.01, (cp, comm, saved, measured)


@pytest.mark.parametrize(
    "dp_shard, cp, dp_replicate, tp, vision, ep",
    [
        (1, 2, 1, 1, "shard", 0),
        (2, 2, 1, 1, "shard", 0),
        (4, 1, 1, 1, "shard", 0),
        (1, 2, 2, 1, "broadcast", 0),
        (1, 2, 1, 2, "shard", 0),
        (2, 1, 1, 2, "replicate", 0),
        # a mixture-of-experts decoder (ep 0: the dense "debug"): its experts with the decoder
        # (ep 1), split over ep and sharded over the rest of dp_shard x cp, with HSDP, with TP
        (2, 1, 1, 1, "shard", 1),
        (2, 2, 1, 1, "shard", 2),
        (1, 2, 2, 1, "shard", 2),
        (1, 2, 1, 2, "shard", 2),
    ],
)
def test_model_state_is_the_trainers_exactly(pool, dp_shard, cp, dp_replicate, tp, vision, ep):
    flavor = "debug_moe" if ep else "debug"
    sp = tp > 1 and not ep  # a MoE decoder's TP plan has no sequence parallelism
    per_rank = pool.run(
        "model_state_bytes",
        dp_shard=dp_shard,
        cp=cp,
        dp_replicate=dp_replicate,
        tp=tp,
        vision=vision,
        flavor=flavor,
        ep=max(ep, 1),
        sp=sp,
    )
    layout = Layout(
        dp_replicate, dp_shard, cp, tp, cp_vision=vision, sequence_parallel=sp, ep=max(ep, 1)
    )
    assert state_bytes(plan_shapes(get_flavor(flavor)), layout).total == per_rank[0]
    assert per_rank[0] == max(per_rank)


@pytest.mark.parametrize("cp", [1, 2])
def test_mixture_of_experts_activations_are_what_autograd_saves(pool, cp):
    """A decoder with q / k norms and two sparse layers (debug_moe): what autograd saves is the
    plan's within 1% (its experts' picks, router and norms priced block by block); the control:
    priced as the dense decoder of the same widths, it is not."""
    measured = max(
        r["bytes"] for r in pool.run("saved_for_backward", cp=cp, seq_len=528, flavor="debug_moe")
    )
    work = cp_scaling_workload(528, sentences=40)
    layout = Layout(cp=cp, mixed_precision="fp32")
    moe = get_flavor("debug_moe")
    saved = sum(activation_bytes(plan_shapes(moe), layout, work, "none").values())
    print(f"cp={cp}: saved {measured}, planned {saved}")
    assert abs(saved / measured - 1) < 0.01
    dense = dataclasses.replace(moe, decoder=dataclasses.replace(moe.decoder, moe=None))
    control = sum(activation_bytes(plan_shapes(dense), layout, work, "none").values())
    assert abs(control / measured - 1) > 0.01


def test_experts_all_to_all_bytes_are_the_plans(pool):
    """Expert parallelism over 2 ranks, a router that spreads the picks evenly over the ranks
    (what the planner assumes): each rank sends exactly comm.ep_layer_bytes; the control, a
    router that keeps every pick on its own rank, sends other bytes. The grouped_mm kernel
    sends the same and computes the same as the loop."""
    tokens = 64
    want = ep_layer_bytes(2 * tokens, 32, 4, 2, 4)
    loop = pool.run("experts_all_to_all", dp_shard=2, tokens=tokens)
    assert [r["bytes"] for r in loop] == [want, want]
    skewed = pool.run("experts_all_to_all", dp_shard=2, tokens=tokens, balanced=False)
    assert [r["bytes"] for r in skewed] != [want, want], skewed
    # the same exchange with torch._grouped_mm for the experts' matmuls: the same bytes, output
    # and gradients on every rank
    grouped = pool.run("experts_all_to_all", dp_shard=2, tokens=tokens, kernel="grouped_mm")
    for a, b in zip(loop, grouped):
        assert a["bytes"] == b["bytes"]
        for x, y in zip([a["out"], *a["grads"]], [b["out"], *b["grads"]]):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), (x - y).abs().max()


def test_plan_prints_every_part(capsys):
    plan_main(["--config", "train_configs/vlm_cp.toml", "--gpu", "cpu"])
    out = capsys.readouterr().out
    for part in (
        "model state 0.006 GiB",  # the default run's log line (README)
        "decoder blocks",
        "checkpointed block inputs",
        "peak memory estimate",
        "cp attention (p2p)",
        "cp attention by cp_comm_type",
        "image embeddings (shard)",
        "fsdp all-gather (decoder)",
        "MFU",
        # the config's placement (auto: its 4 one-sample rows of 256 slots are dealt whole,
        # two per rank; "auto" keeps 2 padding slots each of images and text)
        "cp placement priced (parallelism.cp_sample_placement=auto, cp_image_tokens=auto; the "
        "rows placed as one): local slots per rank [516, 516]: 2 image slots on every rank, 2 "
        "that travel, [512, 512] kept whole",
    ):
        assert part in out, part


def test_search_lists_layouts_that_fit_fastest_first(capsys):
    plan_main(
        [
            "--model.flavor=llava7b",
            "--training.mixed_precision=bf16",
            "--training.local_batch_size=1",
            "--search",
            "--seq-len=32768",
            "--gpus=8",
            "--gpu=h100",
        ]
    )
    out = capsys.readouterr().out
    rows = [
        line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d+\s+\d+\s", line)
    ]
    assert rows, out
    speeds = [float(r[-1].replace(",", "")) for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert all(float(r[11]) <= 0.9 * 80e9 / 2**30 for r in rows)  # peak GiB within the H100's


def test_a_mixture_of_experts_is_priced_and_searched_over_ep(capsys):
    """debug_moe (4 experts, top 2, 2 of 3 layers sparse): the plan of ep=2 x cp=2 names the
    experts' line, their all-to-all and their own FSDP units (ep=2 of dp_shard 2 x cp 2: each
    expert sharded over 2 ranks); --search tries every expert-parallel degree of dp_shard x cp
    (4 experts: 1, 2, 4; not 8)."""
    base = ["--config", "train_configs/vlm_cp.toml", "--model.flavor=debug_moe", "--gpu=cpu"]
    plan_main([*base, "--parallelism.data_parallel_shard_degree=2",
               "--parallelism.expert_parallel_degree=2"])  # fmt: skip
    out = capsys.readouterr().out
    for part in (
        "ep=2",
        "experts: 2 of 3 decoder layers sparse (4 experts of width 64, top 2)",
        "each rank 2 experts, ep=2, FSDP over 2 rank(s)",
        "experts all-to-all",
        "fsdp all-gather (experts)",
    ):
        assert part in out, part
    plan_main([*base, "--search", "--gpus=8", "--top=1000"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    eps = {int(r[6]) for r in rows if len(r) > 8 and r[0].isdigit()}
    assert eps == {1, 2, 4}, eps


def test_qwen_vl_models_are_priced_at_their_image_size(capsys, tmp_path):
    """A Qwen3-VL-MoE folder holding only the config.json transformers writes (the planner reads
    shapes, not weights) at --image-size 64x96: 24 ViT patches and 6 slots an image, its experts
    priced. --search: tensor-parallel layouts without sequence parallelism for Qwen3-VL (which
    has none), with it for Qwen2.5-VL. An image size that is not whole merge units, and another
    size for a llava model, are one line each."""
    from hf_folders import QWEN3_MOE_TEXT, QWEN3_VISION
    from transformers import Qwen3VLMoeConfig

    Qwen3VLMoeConfig(vision_config=QWEN3_VISION, text_config=QWEN3_MOE_TEXT).save_pretrained(
        tmp_path
    )
    qwen3 = ["--model.name=qwen3_vl", "--model.flavor=hf", f"--model.hf_path={tmp_path}"]
    plan_main([*qwen3, "--image-size=64x96", "--gpu=cpu"])
    out = capsys.readouterr().out
    for part in (
        f"plan: qwen3_vl {tmp_path}, ",
        "(1 image(s) of 64x96 px per row, 6 slots and 24 ViT patches each)",
        "experts: 2 of 3 decoder layers sparse (4 experts of width 24, top 2)",
    ):
        assert part in out, part

    def search(argv: list[str]) -> dict[str, set[str]]:
        """The search rows' sequence-parallel column, by whether tp > 1."""
        plan_main([*argv, "--search", "--gpus=4", "--top=1000", "--gpu=cpu"])
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        rows = [r for r in rows if len(r) > 9 and r[0].isdigit()]
        return {tp: {r[5] for r in rows if (r[4] != "1") == (tp == "tp")} for tp in ("tp", "no")}

    assert search(qwen3) == {"tp": {"off"}, "no": {"off"}}
    assert search(["--model.name=qwen2_5_vl"]) == {"tp": {"on"}, "no": {"off"}}
    plan_main(["--model.name=qwen2_5_vl", "--image-size=448x672", "--seq-len=2048", "--gpu=cpu"])
    assert "384 slots and 1536 ViT patches each" in capsys.readouterr().out
    for argv, line in (
        (
            ["--model.name=qwen2_5_vl", "--image-size=448x672"],
            "config error: training.seq_len=256: 1 image(s) of 384 slots (data.images_per_sample, "
            "--image-size) leave no text in a row",
        ),
        (
            [*qwen3, "--image-size=64x90"],
            "config error: --image-size 64x90: a side must be a positive multiple of 32 pixels "
            "(patch_size 16 x spatial_merge_size 2)",
        ),
        (
            ["--image-size=64"],
            "config error: --image-size: a llava model is priced on its own 32x32 images (its "
            "ViT's image_size)",
        ),
        (
            [*qwen3, "--image-size=\u00b2x64"],  # a superscript two: a digit to str.isdigit
            "config error: --image-size: expected HxW in pixels (e.g. 448x672), got '\u00b2x64'",
        ),
    ):
        with pytest.raises(SystemExit):
            plan_main(argv)
        assert capsys.readouterr().err.strip() == line


def test_a_search_whose_every_layout_fails_for_the_same_reason_says_it(capsys, tmp_path):
    """A LLaVA folder without its image processor's files: --search says what is wrong in one
    line (as the plan of one layout does), not "no layout fits"."""
    from hf_folders import TEXT, TOWER, save_llava

    save_llava(tmp_path, TOWER, TEXT)
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit):
        plan_main([f"--model.hf_path={tmp_path}", "--model.flavor=hf", "--search", "--gpus=2"])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "preprocessor_config.json" in err, err


def test_qwen_vl_images_weigh_in_the_placement_as_the_trainers_do():
    """A Qwen2.5-VL image's tower work in the plan (ModelShapes.image_work) is what the
    trainer's images report (QwenVisuals.work, what cp_vision and the "auto" placement weigh);
    with cp_vision = broadcast the rank that encodes the images keeps less text than the
    other. The control: images weighed as one unit each, as a LLaVA image, are placed
    evenly."""
    from dist_checks import family_config

    from titan_vlm.data.batch import Sample, collate

    spec, cfg = family_config("qwen2_5_vl", "debug")
    args = spec.args(cfg)
    rule, slot_data = spec.data_rule(args, cfg)
    shapes = spec.plan_shapes(args, (448, 448))
    image = torch.zeros(3, 448, 448)
    batch = collate([[Sample([image, [1] * 8])]], 264, rule, rule.image_size, 0,
                    slot_data=slot_data)  # fmt: skip
    assert shapes.image_work == pytest.approx(batch.images.work()[0], rel=1e-12)

    def kept(image_work: float) -> list[int]:
        work = Workload.uniform(2048, 4, 1, shapes.tokens_per_image, cost=spec.layout_cost(args),
                                bidirectional_images=False, image_work=image_work)  # fmt: skip
        layout = Layout(cp=2, cp_vision="broadcast", cp_sample_placement="auto")
        return work.placed(layout).kept_slots

    # four one-image samples kept whole: rank 0 encodes all four images, so it keeps one sample
    assert kept(shapes.image_work) == [2048, 4096]
    assert kept(1.0) == [4096, 4096]


def test_bad_input_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(["--gpu", "tpu"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "config error: --gpu: unknown hardware 'tpu' (known: h100, h200, a100, cpu)"
    )


@pytest.mark.parametrize(
    "family, flavor", [("qwen2_5_vl", "debug"), ("qwen3_vl", "debug"), ("qwen3_vl", "debug_moe")]
)
def test_qwen_vl_activations_are_what_autograd_saves(pool, family, flavor):
    """The Qwen-VL families, through their ModelSpec: rows of six images then text, cp 1 and 2;
    what autograd saves is the plan's within 1% (Qwen2.5-VL's RMSNorm / SwiGLU tower and its
    window order, Qwen3-VL's LayerNorm / GELU tower, position taps and DeepStack mergers, the
    tower's patches distinct from the decoder's slots). The control: the tower priced on the
    decoder's slots (one patch a slot, as a LLaVA ViT) is off. The plan's model FLOPs of the rows
    are the trainer's (ModelSpec.flops, what MFU counts)."""
    from dist_checks import family_config

    spec, cfg = family_config(family, flavor)
    shapes = spec.plan_shapes(spec.args(cfg), None)
    v = shapes.vision
    slot_per_patch = dataclasses.replace(
        shapes,
        vision=dataclasses.replace(v, patches=v.tokens, pixels=v.pixels // v.merger.unit),
    )
    for cp in (1, 2):
        runs = pool.run("family_saved_for_backward", family=family, flavor=flavor, cp=cp)
        measured = max(r["bytes"] for r in runs)
        work = Workload(runs[0]["doc"], runs[0]["image"])
        layout = Layout(cp=cp, mixed_precision="fp32")
        saved = sum(activation_bytes(shapes, layout, work, "none").values())
        print(f"{family} {flavor} cp={cp}: saved {measured}, planned {saved}")
        assert abs(saved / measured - 1) < 0.01
        control = sum(activation_bytes(slot_per_patch, layout, work, "none").values())
        assert abs(control / measured - 1) > 0.01
        flops = shapes.train_flops(work.num_images, work.text_tokens, work.whole().whole_pairs)
        assert flops == pytest.approx(runs[0]["flops"], rel=1e-9)


@pytest.mark.parametrize(
    "family, flavor, dp_shard, cp, tp, vision, ep, sp",
    [
        ("qwen2_5_vl", "debug", 2, 2, 1, "shard", 1, False),
        ("qwen2_5_vl", "debug", 1, 2, 2, "broadcast", 1, True),
        ("qwen3_vl", "debug", 1, 2, 2, "shard", 1, False),
        ("qwen3_vl", "debug_moe", 2, 2, 1, "shard", 2, False),
    ],
)
def test_qwen_vl_model_state_is_the_trainers_exactly(
    pool, family, flavor, dp_shard, cp, tp, vision, ep, sp
):
    """The Qwen-VL families' parameters with their TP dims (tower, mergers, DeepStack mergers,
    decoder, experts) give the trainer's model state per rank to the byte: FSDP over dp_shard x
    cp (the tower over dp_shard alone with cp_vision = broadcast), TP (with SP for Qwen2.5-VL),
    experts split over ep."""
    from dist_checks import family_config

    per_rank = pool.run(
        "model_state_bytes",
        family=family,
        flavor=flavor,
        dp_shard=dp_shard,
        cp=cp,
        tp=tp,
        vision=vision,
        ep=ep,
        sp=sp,
    )
    spec, cfg = family_config(family, flavor)
    shapes = spec.plan_shapes(spec.args(cfg), None)
    layout = Layout(1, dp_shard, cp, tp, cp_vision=vision, sequence_parallel=sp, ep=ep)
    assert state_bytes(shapes, layout).total == per_rank[0] == max(per_rank)


@pytest.mark.parametrize(
    "schedule, virtual",
    [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 1)],
)
def test_pipeline_activations_per_rank_are_what_autograd_holds_at_once(pool, schedule, virtual):
    """pp = 2, 4 microbatches of one row, 4 decoder layers: the most bytes autograd holds saved
    at once on each pipeline rank is the plan's within 1% (its stages' saved bytes a microbatch,
    RankPlan.stage_saved, the microbatches alive at the peak in torch's order; the buffers the
    schedule and torch's stages hold besides are priced in the rank's peak, not autograd's, so
    not here). Control: the same stages priced under another
    schedule's order miss the measurement on some rank. A zero-bubble schedule frees a
    microbatch's tensors in two parts (its inputs' backward keeps the graph, its weights'
    frees what it walks): the plan holds them all to the weights' backward, up to 3% above."""
    from titan_vlm.plan.pipeline import peak_alive, rank_actions, rank_plans

    out = pool.run("pipeline_saved_peak", pp=2, schedule=schedule, virtual=virtual, seq_len=264)
    assert all(o["alive_after"] == 0 for o in out)  # every microbatch's backward ran
    args = dataclasses.replace(DEBUG, decoder=dataclasses.replace(DEBUG.decoder, n_layers=4))
    shapes = plan_shapes(args)
    work = Workload(out[0]["doc"], out[0]["image"], cost=layout_cost(args))
    layout = Layout(  # the even split the check's StagePlan makes
        mixed_precision="fp32",
        pp=2,
        pp_schedule=schedule,
        pp_stages_per_rank=virtual,
        pp_stage_layers="2,2" if virtual == 1 else "1,1,1,1",
    )

    def saved(rank_schedule: str) -> list[int]:
        peaks = []
        for r in rank_plans(shapes, layout, work):
            actions = rank_actions(rank_schedule, 2, virtual, 4, r.rank)
            peaks.append(peak_alive(actions, r.stage_saved)[0])
        return peaks

    planned = saved(schedule)
    for o, p in zip(out, planned):
        print(f"{schedule}: held at once {o['peak']}, planned {p}")
        if schedule == "InterleavedZeroBubble":
            assert -0.01 < p / o["peak"] - 1 < 0.03, (p, o["peak"])
        else:
            assert abs(p / o["peak"] - 1) < 0.01, (p, o["peak"])
    other = {"GPipe": "1F1B", "1F1B": "GPipe", "Interleaved1F1B": "InterleavedZeroBubble"}
    control = saved(other.get(schedule, "GPipe"))
    assert any(abs(c / o["peak"] - 1) >= 0.01 for c, o in zip(control, out)), control


@pytest.mark.parametrize(
    "dp_shard, cp, tie, tp",
    [(1, 1, False, 1), (1, 2, False, 1), (2, 1, False, 1), (2, 1, True, 1), (1, 1, True, 2)],
)
def test_each_pipeline_ranks_model_state_is_the_trainers_exactly(pool, dp_shard, cp, tie, tp):
    """pp = 2 (the debug model's 3 layers: stage 0 the tower, projector, embeddings and layers
    0-1; stage 1 layer 2, the norm and head; with `tie`, the head's weight the embeddings', on
    both stages), each stage sharded over dp x cp (and split over tp): every rank's model state
    is its pipeline rank's in the plan; the trainer's line (rank 0's) is the plan's."""
    from titan_vlm.plan.pipeline import rank_plans

    per_rank = pool.run("model_state_bytes", dp_shard=dp_shard, cp=cp, pp=2, tie=tie, tp=tp)
    args = dataclasses.replace(
        DEBUG, decoder=dataclasses.replace(DEBUG.decoder, tie_embeddings=tie)
    )
    layout = Layout(dp_shard=dp_shard, cp=cp, tp=tp, pp=2, pp_microbatch_size=1)
    cfg = JobConfig()  # the rows the trainer's split is balanced for (stage_split)
    work = Workload.uniform(
        cfg.training.seq_len,
        2,
        cfg.data.images_per_sample,
        DEBUG.tokens_per_image,
        cost=layout_cost(DEBUG),
        bidirectional_images=False,
    )
    ranks = rank_plans(plan_shapes(args), layout, work)
    inner = dp_shard * cp * tp  # the mesh's pp dim is the outermost: ranks [0, inner) stage 0
    for rank, state in enumerate(per_rank):
        fsdp_rank_0 = rank % inner == 0  # the largest FSDP shard, as the plan prices
        if fsdp_rank_0:
            assert ranks[rank // inner].state.total == state, (rank, state)
    assert ranks[0].state.total != ranks[1].state.total


def test_plan_prices_a_pipeline(capsys):
    """The default config at pp = 2 (fp32): the bubble, each pipeline rank's stages, state,
    activations with the microbatches alive at its peak, and the stage-to-stage bytes; --search
    tries pipeline degrees and schedules."""
    base = ["--config", "train_configs/vlm_cp.toml", "--gpu=cpu", "--training.mixed_precision=fp32"]
    plan_main([*base, "--parallelism.pipeline_parallel_degree=2"])
    out = capsys.readouterr().out
    for part in (
        "layout: pp=2 (1F1B, 1 stage(s) a rank, microbatches of 1 row(s))",
        "pipeline: 2 ranks x 1 stage(s), 1F1B over 4 microbatches of 1 row(s) a step; modelled "
        "bubble 20% of the step",
        # the cost model's split: the debug model's head (vocabulary 264, width 128) costs more
        # of a layer than its ViT on 3 images of 16 patches
        "[2]; stage 0 (vision, projector, embeddings, layers 0-1)",
        "[1]; stage 1 (layers 2-2, norm, head)",
        "pp stage-to-stage",
        "over 80% of the step (the pipeline's bubble)",
    ):
        assert part in out, part
    plan_main([*base, "--parallelism.pipeline_parallel_degree=2",
               "--parallelism.pipeline_parallel_schedule=GPipe"])  # fmt: skip
    assert "[4]; stage 0" in capsys.readouterr().out  # every microbatch alive
    # a step's rows with accumulation: 4 microsteps of 4 rows, 16 microbatches in one schedule
    plan_main([*base, "--parallelism.pipeline_parallel_degree=2",
               "--training.global_batch_size=16"])  # fmt: skip
    assert "1F1B over 16 microbatches of 1 row(s) a step; modelled bubble 6%" in (
        capsys.readouterr().out
    )
    plan_main([*base, "--search", "--gpus=4", "--top=1000"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in rows if len(r) > 9 and r[0].isdigit()]
    assert {r[7] for r in rows if r[0] == "2"} == {"1F1B", "GPipe"}, rows
    assert {r[0] for r in rows} == {"1", "2"}  # 4 stages: more than the 3 layers
