"""The data pipeline on this machine: loader workers against a step, and start-up by corpus size.

    python benchmarks/data_loader.py [--workers 0,1,2,4] [--image-sizes 336x336,1600x1200]
        [--step-s 0.25] [--steps 24] [--startup-records 1000,10000,100000] [--startup-ranks 1,2]
        [--startup-workers 0,2] [--format-records 100000]

A corpus like the ones people fine-tune VLMs on, made here with a seed (nothing downloaded):
58% one image and a 1-3 round chat, 15% 2-4 images, 12% text only, 10% captions, 5% 6-16 frame
videos (as frame files), 250-1800 characters of text; JPEGs of the given size (64 distinct
files, so after the first epoch they come from the page cache, as a hot corpus's do).
Rows of LLaVA-1.5's shapes: 336 px images of 576 slots, 4096-slot rows, 8 rows a batch, packed,
the byte tokenizer (data/jsonl.py JsonlDataset, as the trainer builds it for a .jsonl file).

1. Loader workers (data/loader.py BatchLoader), by image size and data.num_workers: the step is
   simulated by sleeping --step-s seconds (a GPU step leaves the host's cores free), and the table
   gives the mean seconds a step waited for its batch after the first (data_wait_s), batches per
   second with no step at all (what the workers can build), and CPU seconds per batch (this
   process and its workers, from getrusage).
2. Start-up (the JsonlDataset the trainer builds on every rank: the files' record spans found,
   then the first window's pass (data.index_window, 16384 records), shared by the ranks:
   data/shared_pass.py, each rank's share split again over it and its data.num_workers,
   --startup-workers: data/forked.py): the slowest rank's seconds and the largest peak resident
   memory (a rank's, and a worker's) by corpus size (records of the same mix, image files that
   exist), number of ranks and of workers, on a fresh gloo group each; the spans scanned (and
   written to an index cache), then mapped from that cache (data/index_cache.py: a restart's or
   a resume's start-up); and the seconds of the next window's pass (the wait of the step that
   reaches it).
3. Start-up by format (--format-records records, 1 rank, spans scanned): the same records as
   JSONL, Parquet (row groups of 1,000), an Arrow IPC stream (as save_to_disk writes them) and a
   WebDataset tar (one .json member a record), images beside the data.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _group import run_group
from PIL import Image

from titan_vlm.data.index_cache import IndexCache
from titan_vlm.data.jsonl import JsonlDataset
from titan_vlm.data.loader import BatchLoader
from titan_vlm.data.shared_pass import GroupShare
from titan_vlm.data.tokenizer import ByteTokenizer

IMAGE, SLOTS, SEQ, ROWS = 336, 576, 4096, 8  # LLaVA-1.5's images, 4096-slot rows, 8 a batch
FILES = 64  # distinct JPEGs of a size
WORDS = "the a small large red blue green circle square over under near left right of and".split()


def text(rng: random.Random, lo: int = 250, hi: int = 1800) -> str:
    n = rng.randint(lo, hi)
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def record(rng: random.Random, images: list[str]) -> dict:
    """One record of the mix (module docstring)."""
    kind = rng.random()
    if kind < 0.10:  # a caption
        return {"image": rng.choice(images), "text": text(rng, 60, 400)}
    if kind < 0.22:  # text only
        return {"conversations": chat(rng, rng.randint(1, 3), "")}
    if kind < 0.37:  # 2-4 images
        k = rng.randint(2, 4)
        return {
            "images": [rng.choice(images) for _ in range(k)],
            "conversations": chat(rng, rng.randint(1, 3), "<image>\n" * k),
        }
    if kind < 0.42:  # a video of 6-16 frames
        frames = [rng.choice(images) for _ in range(rng.randint(6, 16))]
        return {"video": frames, "conversations": chat(rng, 1, "<video>\n")}
    return {"image": rng.choice(images), "conversations": chat(rng, rng.randint(1, 3), "<image>\n")}


def chat(rng: random.Random, rounds: int, media: str) -> list[dict]:
    turns = []
    for r in range(rounds):
        share = 1 / (2 * rounds)
        turns.append({"from": "human", "value": (media if r == 0 else "") + text(rng, 40, 200)})
        turns.append({"from": "gpt", "value": text(rng, int(250 * share), int(1600 * share))})
    return turns


def write_corpus(folder: Path, records: int, size: tuple[int, int], seed: int = 0) -> Path:
    """`records` records of the mix over FILES JPEGs of `size` (h, w) in `folder`."""
    rng = random.Random(seed)
    h, w = size
    images = []
    for i in range(FILES):
        name = f"{h}x{w}_{i}.jpg"
        if not (folder / name).exists():
            g = np.random.default_rng(i)
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([(x * (i + 1) % 256), (y * 3 % 256), ((x + y) % 256)], -1)
            noisy = base + g.normal(0, 24, (h, w, 3))  # photo-like: the JPEG is not trivial
            Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(folder / name, quality=90)
        images.append(name)
    path = folder / f"corpus_{h}x{w}_{records}.jsonl"
    with open(path, "w") as f:
        for _ in range(records):
            f.write(json.dumps(record(rng, images)) + "\n")
    return path


def dataset(
    path: Path, share: GroupShare | None = None, cache: IndexCache | None = None, workers: int = 0
) -> JsonlDataset:
    """The corpus as the trainer reads it at these shapes (`share`: the ranks sharing its window
    passes; `cache`: where its records' spans are kept between runs; `workers`: data.num_workers,
    which split each rank's share of a pass)."""
    return JsonlDataset(
        str(path),
        ByteTokenizer(),
        IMAGE,
        SLOTS,
        SEQ,
        0,
        packing=True,
        log_startup=False,
        share=share,
        cache=cache,
        workers=workers,
    )


def converted(path: Path, fmt: str) -> Path:
    """The JSONL corpus `path` as a `fmt` file beside it (parquet, arrow or tar), the same records
    (a table's columns: the keys any record has; null where one lacks it)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    out = path.with_suffix(f".{fmt}")
    if fmt == "tar":
        with tarfile.open(out, "w") as tar:
            for i, r in enumerate(records):
                raw = json.dumps(r).encode()
                info = tarfile.TarInfo(f"{i:08d}.json")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
        return out
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = ["image", "images", "video", "text", "conversations"]
    table = pa.table({k: [r.get(k) for r in records] for k in keys})
    if fmt == "parquet":
        pq.write_table(table, out, row_group_size=1000)
    else:
        with pa.ipc.new_stream(str(out), table.schema) as sink:
            sink.write_table(table, max_chunksize=1000)
    return out


def cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers, once they have exited
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def loader_row(path: Path, workers: int, steps: int, step_s: float) -> tuple[float, float, float]:
    """(mean data_wait after the first step, batches/s with no step, CPU s per batch)."""
    data = dataset(path)
    waits = []
    batches = BatchLoader(data, 0, 1, ROWS, workers, 2, 2 * steps, torch.device("cpu"))
    for k in range(steps):
        begin = time.perf_counter()
        batches.batch(k)
        waits.append(time.perf_counter() - begin)
        time.sleep(step_s)
    batches.close()
    cpu0 = cpu_s()
    batches = BatchLoader(data, 0, 1, ROWS, workers, 2, 2 * steps, torch.device("cpu"))
    batches.batch(steps)  # the workers started
    begin = time.perf_counter()
    for k in range(steps + 1, 2 * steps):
        batches.batch(k)
    rate = (steps - 1) / (time.perf_counter() - begin)
    batches.close()
    return sum(waits[1:]) / (steps - 1), rate, (cpu_s() - cpu0) / steps


def startup_worker(rank: int, size: int, results, path: str, cache: str, workers: int = 0) -> None:
    """One rank of `size` building the dataset, its first window's pass shared as the trainer
    shares it (data/shared_pass.py) and split over `workers` more processes a rank, its index
    cache in folder `cache` ("": none), then indexing the next window; rank 0 reports the
    slowest rank's seconds of each and the largest peaks (a rank's; a worker's, from
    getrusage)."""
    dist.barrier()
    begin = time.perf_counter()
    data = dataset(
        Path(path),
        GroupShare(dist.group.WORLD) if size > 1 else None,
        IndexCache(Path(cache)) if cache else None,
        workers,
    )
    seconds = time.perf_counter() - begin
    begin = time.perf_counter()
    first = data.windows[0]
    if data.order.windows > 1:
        data.ensure(range(first.first, first.stop))  # the row after window 0's: window 1
    window_s = time.perf_counter() - begin
    # VmHWM: this process's peak resident set since it started (spawned: its own), file pages
    # it mapped included (the ranks of a node share those: the page cache); RssAnon: its own
    # memory now, the index it keeps
    status = Path("/proc/self/status").read_text()
    kib = {k: int(status.split(f"{k}:")[1].split()[0]) for k in ("VmHWM", "RssAnon")}
    worker_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # 0: none ran
    worst = torch.tensor(
        [seconds, kib["VmHWM"] / 1024, kib["RssAnon"] / 1024, worker_mib, window_s]
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put(
            {"s": float(worst[0]), "peak_mib": float(worst[1]), "own_mib": float(worst[2])}
            | {"worker_mib": float(worst[3]), "window_s": float(worst[4])}
            | {"rows": len(first.rows)}  # the index measured is alive
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="0,1,2,4")
    p.add_argument("--image-sizes", default="336x336,1600x1200")
    p.add_argument("--step-s", type=float, default=0.25, help="the simulated step (seconds)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--records", type=int, default=2000, help="the loader table's corpus")
    p.add_argument("--startup-records", default="1000,10000,100000")
    p.add_argument("--startup-ranks", default="1,2", help="ranks sharing the window passes")
    p.add_argument("--startup-workers", default="0,2", help="data.num_workers in the pass")
    p.add_argument("--format-records", type=int, default=100000)
    a = p.parse_args()
    torch.set_num_threads(1)  # as a rank under run_train.sh (OMP_NUM_THREADS=1)
    folder = Path(tempfile.mkdtemp(prefix="data_loader_"))
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, corpus in {folder}")
    print(f"rows: {ROWS} x {SEQ} slots, {IMAGE} px images of {SLOTS} slots, packed")
    print(
        f"\n| JPEG size | num_workers | data_wait_s (step {a.step_s} s) | batches/s "
        "(no step) | CPU s / batch |"
    )
    print("|---|---|---|---|---|")
    for size in a.image_sizes.split(","):
        h, w = (int(v) for v in size.split("x"))
        path = write_corpus(folder, a.records, (h, w))
        for workers in (int(v) for v in a.workers.split(",")):
            wait, rate, cpu = loader_row(path, workers, a.steps, a.step_s)
            print(f"| {h}x{w} | {workers} | {wait:.3f} | {rate:.2f} | {cpu:.3f} |", flush=True)
    print(
        "\n| records | file MiB | ranks | num_workers | spans | start-up s (slowest rank) | "
        "next window s | peak RSS MiB (largest rank) | a worker's peak RSS MiB | own memory "
        "after, MiB (largest) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in (int(v) for v in a.startup_records.split(",")):
        path = write_corpus(folder, n, (64, 64))
        mib = path.stat().st_size / 2**20
        for ranks in (int(v) for v in a.startup_ranks.split(",")):
            for workers in (int(v) for v in a.startup_workers.split(",")):
                cache = tempfile.mkdtemp(prefix="index_", dir=folder)  # scanned, then mapped
                for spans in ("scanned", "mapped from the cache"):
                    (r,) = run_group(startup_worker, ranks, 1, str(path), cache, workers)
                    print(
                        f"| {n} | {mib:.1f} | {ranks} | {workers} | {spans} | {r['s']:.2f} | "
                        f"{r['window_s']:.2f} | {r['peak_mib']:.0f} | {r['worker_mib']:.0f} | "
                        f"{r['own_mib']:.0f} |",
                        flush=True,
                    )
    print("\n| format | records | file MiB | start-up s | peak RSS MiB | own memory after, MiB |")
    print("|---|---|---|---|---|---|")
    path = write_corpus(folder, a.format_records, (64, 64), seed=1)
    for fmt in ("jsonl", "parquet", "arrow", "tar"):
        data = path if fmt == "jsonl" else converted(path, fmt)
        (r,) = run_group(startup_worker, 1, 1, str(data), "")
        mib = data.stat().st_size / 2**20
        print(
            f"| {fmt} | {a.format_records} | {mib:.1f} | {r['s']:.2f} | {r['peak_mib']:.0f} | "
            f"{r['own_mib']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
