"""What a user watches besides the training loss: the validation loss (validation.*), profiler
traces (profiling.*) and Weights & Biases (metrics.enable_wandb)."""

import json
import struct
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

RUN = dict(
    training__seq_len=61,
    training__local_batch_size=2,
    training__warmup_steps=1,
    data__packing=True,
    data__sentences_per_image=2,
    validation__steps=2,
)


@pytest.mark.parametrize(
    "dp_shard, cp",
    [(1, 2), (2, 1)],
    ids=["cp2_profiled", "fsdp2_compiled"],
)
def test_validation_loss_equals_one_process_evaluating_the_same_rows(pool, tmp_path, dp_shard, cp):
    """The cp=2 run takes profiler traces too; the FSDP run compiles its blocks (aot_eager,
    fullgraph), whose graphs under no_grad are new ones within the recompile budget."""
    profiled = cp == 2
    out = pool.run(
        "validation_run",
        dp_shard=dp_shard,
        cp=cp,
        steps=2,
        job__dump_folder=str(tmp_path),
        profiling__enable_profiling=profiled,
        profiling__profile_freq=2,
        compile__enable=not profiled,
        compile__backend="aot_eager",
        **RUN,
    )
    for rank in out:  # the same number on every rank
        assert rank["validation_loss"] == out[0]["validation_loss"]
    got = out[0]
    assert got["validation_loss"] == pytest.approx(got["reference"], rel=1e-5)
    # negative controls: the mean of the dp ranks' own means, and the training data's rows
    assert abs(got["training_rows"] / got["reference"] - 1) > 1e-3
    if dp_shard > 1:
        assert abs(got["mean_of_means"] / got["reference"] - 1) > 1e-4
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [("validation_loss" in line) for line in lines] == [False, True]  # validation.freq=2
    assert lines[1]["validation_loss"] == got["validation_loss"]
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("validation_loss")] == [2]
    if profiled:
        for rank in range(2):
            trace = json.loads(
                (tmp_path / "profile_traces" / "iteration_2" / f"rank{rank}_trace.json").read_text()
            )
            names = {event.get("name", "") for event in trace["traceEvents"]}
            assert "ProfilerStep#1" in names  # the run's second step (the profiler counts from 0)
            assert any(name.startswith("aten::") for name in names)
        assert not (tmp_path / "profile_traces" / "iteration_1").exists()


def wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (.wandb): a 7-byte header (":W&B", a magic, a version),
    then LevelDB-style log blocks of 32 KiB whose records (CRC32C, length, type; a record split
    over blocks is FIRST, MIDDLE..., LAST) each hold one wandb.proto Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, pieces, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def test_wandb_gets_the_metrics_offline(pool, tmp_path):
    history = pool.run(
        "wandb_run",
        steps=2,
        job__dump_folder=str(tmp_path),
        metrics__enable_tensorboard=False,
        validation__enable=True,
        validation__freq=2,
        **RUN,
    )[0]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    logged = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            logged[record.history.step.num] = {
                item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items
            }
    assert sorted(logged) == [1, 2]
    for h in history:
        for key in ("loss", "grad_norm", "lr", "tokens_per_sec"):
            assert logged[h["step"]][key] == h[key]
    assert logged[2]["validation_loss"] == history[1]["validation_loss"]
    assert "validation_loss" not in logged[1]


def test_data_wait_is_the_slowest_ranks_and_a_data_bound_step_says_so(pool, tmp_path):
    """data_wait_s (metrics.jsonl, TensorBoard, the log line): how long the step waited for its
    batch, the slowest rank's. CP rank 1's dataset sleeps 0.5 s a batch: every step's
    data_wait_s is at least that, within its step time, on every rank's record, and rank 0 (the
    one that logs) warns at each logged step that it is data-bound, saying the batches are built
    in the training process (data.num_workers=0). With 2 loader workers, step 2's batch is built
    while step 1 waits for its own: step 2 waits for nothing like the delay, and the warnings
    name the workers. The control: the same run without the delay waits less than the delay."""
    run = dict(dp_shard=1, cp=2, steps=3, metrics__log_freq=1, **RUN)

    def slow_run(workers: int) -> list[dict]:
        return pool.run(
            "train_run_with_slow_data",
            delay_s=0.5,
            job__dump_folder=str(tmp_path / f"slow{workers}"),
            data__num_workers=workers,
            **run,
        )

    for rank, out in enumerate(slow_run(0)):
        assert all(0.5 <= h["data_wait_s"] <= h["step_time_s"] for h in out["history"])
        bound = [w for w in out["warnings"] if "for its batch: data-bound" in w]
        assert len(bound) == (3 if rank == 0 else 0), out["warnings"]
        assert all(
            "data.num_workers=0 builds each batch in the training process" in w for w in bound
        )
    for rank, out in enumerate(slow_run(2)):
        first, second = (h["data_wait_s"] for h in out["history"][:2])
        assert first >= 0.5 and second < 0.4, out["history"]
        bound = [w for w in out["warnings"] if "for its batch: data-bound" in w]
        assert bool(bound) == (rank == 0), out["warnings"]
        assert all("2 loader workers per rank do not keep up" in w for w in bound)
    fast = pool.run("train_run", job__dump_folder=str(tmp_path / "f"), **run)
    assert all(h["data_wait_s"] < 0.5 for rank in fast for h in rank)
