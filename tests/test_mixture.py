"""A weighted mixture of sources (data/mixture.py): the pattern gives each source its weight's
share of every period, row for row as a step-by-step smooth weighted round robin deals them;
the mixture's batches are the sources' own rows in that order (every tensor); bad samples of
every source are counted apart; loader workers change nothing; a real run resumes on it to the
bit; and its keys are checked in one line."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from test_jsonl_data import RECORDS, TRAIN, dataset, files, interrupted_run, tensors  # noqa: F401
from test_loader import STEPS, loader
from test_record_files import tar_shards

from titan_vlm.config import ConfigError, load_config
from titan_vlm.data.bad_samples import BadSampleLog
from titan_vlm.data.batch import collate
from titan_vlm.data.dataset import keep_one_slot
from titan_vlm.data.mixture import MixtureDataset, Schedule, parse_mixture
from titan_vlm.data.tokenizer import ByteTokenizer
from titan_vlm.resume_config import DATA_FILE, run_facts
from titan_vlm.validate import validate_job

PAD, IMAGE = ByteTokenizer.PAD, ByteTokenizer.IMAGE


def dealt(weights: list[int], rows: int) -> list[tuple[int, int]]:
    """The reference: nginx's smooth weighted round robin, step by step (each row: every source
    gains its weight, the one with the most, the first of equals, is picked and loses the sum),
    with the number of rows each source was dealt before."""
    current, seen, out = [0] * len(weights), [0] * len(weights), []
    for _ in range(rows):
        current = [c + w for c, w in zip(current, weights)]
        s = current.index(max(current))
        current[s] -= sum(weights)
        out.append((s, seen[s]))
        seen[s] += 1
    return out


@pytest.mark.parametrize(
    ("weights", "shares"),
    [(["3", "1"], [3, 1]), (["0.7", "0.3"], [7, 3]), (["2", "2", "1/2"], [4, 4, 1])],
)
def test_the_pattern_deals_each_source_its_share(weights, shares):
    schedule = Schedule([Fraction(w) for w in weights])
    assert schedule.shares == shares and schedule.period == sum(shares)
    rows = 5 * schedule.period + 3
    assert [schedule.row(r) for r in range(rows)] == dealt(shares, rows)
    far = 10**12 + 5  # a row of a long run, without dealing the rows before it
    window = [schedule.row(r)[0] for r in range(far, far + schedule.period)]
    assert [window.count(s) for s in range(len(shares))] == shares
    assert (
        schedule.row(far)[1] - schedule.row(far - schedule.period)[1]
        == shares[schedule.row(far)[0]]
    )


def test_the_3_1_pattern_spreads_the_small_source():
    assert [Schedule([Fraction(3), Fraction(1)]).row(r) for r in range(8)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (0, 2),
        (0, 3),
        (0, 4),
        (1, 1),
        (0, 5),
    ]


def sources(folder) -> tuple:
    """Two sources: test_jsonl_data's train.jsonl (13 records, 9 samples) and OBJECTS (12
    records) as two WebDataset shards, images as members (made once)."""
    if not (folder / "wds").exists():
        (folder / "wds").mkdir()
        for shard in tar_shards(folder, 2):
            shard.rename(folder / "wds" / shard.name)
    return folder / "train.jsonl", folder / "wds"


def mixture(folder, weights=("3", "1")) -> MixtureDataset:
    bad = BadSampleLog("data.mixture", "skip")
    built = [dataset(p, shuffle=True, image_root=str(folder), bad=bad) for p in sources(folder)]
    return MixtureDataset(built, [Fraction(w) for w in weights], bad)


def test_the_mixture_reads_the_sources_rows_in_the_dealt_order(files):  # noqa: F811
    """Each batch (2 dp ranks, 3 rows each, 4 steps: past both sources' first epochs) is, tensor
    for tensor, the rows the reference deals read from each source by itself; the counters
    are the sources' together, their dropped samples numbered apart."""
    mix = mixture(files)
    alone = [dataset(p, shuffle=True, image_root=str(files)) for p in sources(files)]
    deal = dealt([3, 1], 4 * 2 * 3)
    for step in range(4):
        for rank in range(2):
            got = mix.batch(step, rank, 2, 3)
            first = (step * 2 + rank) * 3
            read = []
            for s, own in deal[first : first + 3]:
                alone[s].ensure(range(own, own + 1))
                read.append(alone[s].rows_of(alone[s].plan([own]))[0])
            read = keep_one_slot(read, ByteTokenizer())  # a batch whose samples all dropped
            want = collate(read, mix.seq_len, mix.slots, mix.image_size, PAD, IMAGE, None)
            assert len(tensors(got)) == len(tensors(want))
            for x, y in zip(tensors(got), tensors(want)):
                assert torch.equal(x, y), (step, rank)
    rows = 4 * 2 * 3  # the global rows read: both sources' first window reached
    assert mix.bad_samples(rows) == sum(sum(a.skipped.values()) for a in alone) > 0
    assert mix.truncated_samples(rows) == sum(a.truncated for a in alone)
    offset = alone[0].records
    assert set(mix.dropped) == set(alone[0].dropped) | {offset + i for i in alone[1].dropped}
    assert alone[0].dropped and alone[1].dropped  # both sources dropped samples
    assert "mixture of 2 sources, rows dealt 3:1: [0] " in mix.describe()
    # the control: other weights deal other rows
    other = mixture(files, weights=("1", "1"))
    assert not all(
        torch.equal(x, y)
        for x, y in zip(tensors(other.batch(0, 0, 2, 3)), tensors(mix.batch(0, 0, 2, 3)))
    )


def test_loader_workers_build_the_mixtures_batches(files):  # noqa: F811
    """2 loader workers: every tensor of every step and the dropped samples (numbered across
    the sources, from the workers' reports) as the training process builds them."""
    runs = {}
    for workers in (0, 2):
        mix = mixture(files)
        batches = loader(mix, workers)
        steps = [tensors(batches.batch(k)[0]) for k in range(STEPS)]
        batches.close()
        runs[workers] = steps, sorted(mix.dropped)
    for got, want in zip(runs[2][0], runs[0][0]):
        assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
    assert runs[2][1] == runs[0][1] and runs[0][1]


def test_the_keys_are_checked_in_one_line(files):  # noqa: F811
    first, second = sources(files)
    assert parse_mixture(f"3 {first}, 1 {second}") == [(3, str(first)), (1, str(second))]
    for value, words in [
        (f"3 {first}", "at least two sources"),
        (f"{first}, 1 {second}", "expected 'WEIGHT SOURCE'"),
        (f"x {first}, 1 {second}", "the weight 'x' is not a number"),
        (f"0 {first}, 1 {second}", "a weight must be > 0"),
        (f"1/0 {first}, 1 {second}", "the weight '1/0' is not a number"),
        (f"1e-9 {first}, 1 {second}", "the weight 1e-9 needs a pattern of more than"),
        (f"1e-100000000 {first}, 1 {second}", "a weight must be > 0"),
        (f"0.12347 {first}, 1 {second}", "weights 12347:100000 need a pattern of 112347 rows"),
    ]:
        cfg = load_config(["--data.dataset=mixture", f"--data.mixture={value}"])
        with pytest.raises(ConfigError, match=words):
            validate_job(cfg, 1)
    cases = [
        (["--data.dataset=mixture"], 'data.dataset = "mixture" needs data.mixture'),
        ([f"--data.mixture=1 {first}, 1 {second}"], 'set data.dataset = "mixture"'),
        (
            ["--data.dataset=mixture", f"--data.mixture=1 {first}, 1 {files / 'none.jsonl'}"],
            "^data.mixture: file not found: ",
        ),
        (
            [
                "--data.dataset=mixture",
                f"--data.mixture=1 {first}, 1 {second}",
                "--validation.enable",
                "--validation.dataset=mixture",
            ],
            "^validation.dataset: one source",
        ),
    ]
    for argv, words in cases:
        with pytest.raises(ConfigError, match=words):
            validate_job(load_config(argv), 1)


def test_a_resume_sees_a_change_in_any_source(files):  # noqa: F811
    first, second = sources(files)

    def facts(weights: str = "3") -> str:
        argv = ["--data.dataset=mixture", f"--data.mixture={weights} {first}, 1 {second}"]
        return run_facts(load_config(argv), 4)[DATA_FILE]

    before = facts()
    assert before.startswith("3 files, ")  # train.jsonl and the two shards
    shard = second / "shard-0001.tar"
    raw = bytearray(shard.read_bytes())
    raw[600] ^= 1  # one bit of the second source's second shard
    shard.write_bytes(bytes(raw))
    assert facts() != before


def test_training_on_a_mixture_resumes_bit_exact(pool, files, tmp_path):  # noqa: F811
    """2 ranks: the uninterrupted run (every batch in the training process), and the run that
    dies after step 3 with 2 loader workers a rank, resumed with 1: the same losses to the bit
    and the same bad-sample counts, from both sources."""
    first, second = sources(files)
    run = dict(
        data__dataset="mixture",
        data__mixture=f"3 {first}, 1 {second}",
        data__image_root=str(files),
        **TRAIN,
    )
    whole, _ = interrupted_run(pool, tmp_path, run)
    assert whole[-1]["data_bad_samples"] > whole[0]["data_bad_samples"] > 0
