"""profiling.py: which steps a run traces (every profile_freq-th step of the global count, also
after a resume) and that each trace is of that step, never an empty one when the run ends."""

import json

import pytest
import torch

from titan_vlm.config import Profiling
from titan_vlm.profiling import StepProfiler


def traced(tmp_path, freq: int, first_step: int, last_step: int) -> dict[int, set[str]]:
    """Run steps first_step+1..last_step, step k doing k additions; {step: op names} traced."""
    cfg = Profiling(enable_profiling=True, profile_freq=freq)
    with StepProfiler(cfg, str(tmp_path), 0, torch.device("cpu"), first_step) as prof:
        for step in range(first_step + 1, last_step + 1):
            with torch.profiler.record_function(f"step{step}"):
                x = torch.ones(4)
                for _ in range(step):
                    x = x + 1
            prof.step(step)
    out = {}
    for folder in (tmp_path / "profile_traces").glob("iteration_*"):
        trace = json.loads((folder / "rank0_trace.json").read_text())
        out[int(folder.name.split("_")[1])] = {e.get("name", "") for e in trace["traceEvents"]}
    return out


@pytest.mark.parametrize(
    "freq, first, last, want",
    [(1, 0, 3, [1, 2, 3]), (2, 0, 5, [2, 4]), (3, 4, 9, [6, 9]), (10, 0, 19, [10])],
    ids=["every", "every_2nd_ending_before_one", "resumed", "freq_10"],
)
def test_traces_the_multiples_of_profile_freq(tmp_path, freq, first, last, want):
    got = traced(tmp_path, freq, first, last)
    assert sorted(got) == want
    for step, names in got.items():  # each is its own step, with its ops
        assert f"step{step}" in names and "aten::add" in names
        assert not any(
            n.startswith("step") and n != f"step{step}" for n in names if n[4:].isdigit()
        )
