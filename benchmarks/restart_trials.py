"""Is the restart after a killed worker reliable? Repeats tests/test_restart.py's trial:

    python benchmarks/restart_trials.py [--trials 10] [--steps 8] [--kill-after 4]

One uninterrupted ./run_train.sh job, then `--trials` jobs with job.max_restarts=1 in which one
worker (alternating LOCAL_RANK 1 and 0) is killed with SIGKILL once metrics.jsonl shows step
`--kill-after` (a trial varies where in the step, or in a checkpoint save, the kill lands). A trial
succeeds when the job exits 0 after a resume and metrics.jsonl holds every step once with the
uninterrupted run's loss, bit for bit. Prints one line per trial and the count.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from torchrun_kill import kill_worker_and_resume, logged_steps, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-after", type=int, default=4)
    ap.add_argument("--keep-logs", default=".", help="folder for the stderr of failed trials")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rc, _, err = run(Path(tmp) / "whole", a.steps)
        if rc != 0:
            sys.exit(f"the uninterrupted run failed: {err[-2000:]}")
        whole = logged_steps(Path(tmp) / "whole")
        ok = 0
        for trial in range(a.trials):
            dump = Path(tmp) / f"trial{trial}"
            begin = time.perf_counter()
            try:
                rc, out, err = kill_worker_and_resume(
                    dump, a.steps, a.kill_after, local_rank=1 - trial % 2
                )
                steps = logged_steps(dump)
                if rc != 0:
                    (Path(a.keep_logs) / f"trial{trial}.stderr").write_text(err)
                    verdict = f"FAILED: exit {rc} (stderr: {a.keep_logs}/trial{trial}.stderr)"
                elif "resumed from" not in out:
                    verdict = "FAILED: no resume"
                elif steps != whole:
                    verdict = f"FAILED: losses differ: {steps} vs {whole}"
                else:
                    verdict = "ok"
            except Exception as e:  # noqa: BLE001 - a trial's failure is a result, not a crash
                verdict = f"FAILED: {e}"
            ok += verdict == "ok"
            print(
                f"trial {trial}: killed local rank {1 - trial % 2} after step {a.kill_after}: "
                f"{verdict} ({time.perf_counter() - begin:.0f} s)",
                flush=True,
            )
        print(f"{ok} of {a.trials} trials resumed and matched the uninterrupted run exactly")


if __name__ == "__main__":
    main()
