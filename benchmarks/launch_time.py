"""How long ./run_train.sh takes around the training itself:

    python benchmarks/launch_time.py [--runs 3] [--steps 1] [-- extra overrides]

Runs the default config (cp = 2, debug model, a checkpoint at the end) `--runs` times and times,
from the command's start, three moments: the mesh line (the launcher has validated, torchrun
has started the workers, which have imported titan_vlm and joined their process group), the
`done` line (the steps and the checkpoint), and the command's exit (the workers', torchrun's
and the launcher's way out). Prints one row per run and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(dump: Path, steps: int, extra: list[str]) -> tuple[float, float, float]:
    """(mesh line, done line, exit) in seconds from the start of ./run_train.sh."""
    begin = time.perf_counter()
    proc = subprocess.Popen(
        [
            "./run_train.sh",
            "--config",
            "train_configs/vlm_cp.toml",
            f"--training.steps={steps}",
            "--metrics.enable_tensorboard=false",
            f"--job.dump_folder={dump}",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    mesh = done = float("nan")
    for line in proc.stdout:
        now = time.perf_counter() - begin
        if "] mesh: " in line:
            mesh = now
        elif line.rstrip().endswith("] done"):
            done = now
    if proc.wait() != 0:
        sys.exit(f"./run_train.sh exited {proc.returncode}")
    return mesh, done, time.perf_counter() - begin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("extra", nargs="*", help="config overrides (after --)")
    a = ap.parse_args()
    rows = []
    print("run | mesh line s | done s | exit s | after done s")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            mesh, done, end = one_run(Path(tmp) / f"run{i}", a.steps, a.extra)
            rows.append((mesh, done, end, end - done))
            print(f"{i} | {mesh:.2f} | {done:.2f} | {end:.2f} | {end - done:.2f}", flush=True)
    medians = [statistics.median(col) for col in zip(*rows)]
    print("median | " + " | ".join(f"{m:.2f}" for m in medians))


if __name__ == "__main__":
    main()
