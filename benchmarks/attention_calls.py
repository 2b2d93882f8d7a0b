"""Attention kernel launches per decoder layer per step, before and after whole-plan execution:
python benchmarks/attention_calls.py

Counted from the plans themselves, no kernel runs, so the CUDA column needs no GPU: it is the
number of varlen calls the packing (titan_vlm/varlen.py) makes, one FlashAttention-2 varlen
launch each (`kernel_launches` with the cuda_flash varlen kernel). Columns, for one rank's
forward of one decoder layer (the backward launches as many again):

  blocks      before: one block-kernel launch per block of the block plans (layout.plan), each
              followed by a float32 log-sum-exp merge into the accumulators (the old executor;
              the ring also ran the image keys as a plan of their own)
  cpu         after, on CPU: the reference executor's aten CPU-flash launches (a loop over the
              packed sequences; a causal sequence with more keys than queries is two)
  cuda        after, on CUDA: varlen launches (one per plan and causality)
  merges      after: log-sum-exp merges of whole plans (ring steps only)

Rows: the default config's packed data (train_configs/vlm_cp.toml: 4 rows x 256 slots, debug
flavor, up to 3 images of 16 slots per sample; the first step's batch) and rows of 8192 slots
holding 2, 8, 32, 128 samples, every other one with an image mid-text.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from titan_vlm.config import load_config
from titan_vlm.data.batch import Batch, Sample, collate
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.kernels import KERNELS
from titan_vlm.layout import SeqLayout, build_layout
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.parallel.cp_attention import CP_ATTENTION, attention_plans, kernel_launches

DEFAULT_CONFIG = Path(__file__).parent.parent / "train_configs" / "vlm_cp.toml"
ROW = 8192
TPI = 16


def default_batch() -> Batch:
    cfg = load_config(["--config", str(DEFAULT_CONFIG)])
    args, t = get_flavor(cfg.model.flavor), cfg.training
    data = SyntheticCaptions(
        args.vision.image_size,
        args.tokens_per_image,
        t.seq_len,
        t.seed,
        cfg.data.sentences_per_image,
        images_per_sample=cfg.data.images_per_sample,
        packing=cfg.data.packing,
    )
    return data.batch(0, 0, 1, t.local_batch_size)


def rows_of(samples: int, rows: int = 2, seq_len: int = ROW) -> Batch:
    """`rows` rows of `samples` samples each filling `seq_len`, every other one with an image of
    TPI slots after its first 3 text tokens; the rows differ (one sample shorter in row 1)."""
    image = torch.zeros(3, 8, 8)
    per = seq_len // samples

    def sample(i: int, length: int) -> Sample:
        if i % 2:
            text = list(range(length - TPI))
            return Sample([text[:3], image, text[3:]])
        return Sample([list(range(length))])

    batch = [[sample(i, per - (b and i == 0)) for i in range(samples)] for b in range(rows)]
    return collate(batch, seq_len, TPI, 8, pad_id=0)


def blocks_before(layout: SeqLayout, comm: str | None) -> int:
    """Block-kernel launches of the old per-block executor."""
    if comm == "p2p":
        names = [("local", "images")] + [("local", s) for s in range(len(layout.texts))]
    else:
        names = attention_plans(comm, len(layout.texts), layout.rank)
    return sum(len(layout.blocks(q, k)) for q, k in names)


def counts(batch: Batch, cp: int, comm: str | None) -> dict:
    """The worst CP rank's launches per decoder layer forward."""
    out = {"blocks": 0, "cpu": 0, "cuda": 0}
    for rank in range(cp):
        _, layout = build_layout(batch.doc, batch.image, cp, rank)
        out["blocks"] = max(out["blocks"], blocks_before(layout, comm))
        out["cpu"] = max(out["cpu"], kernel_launches(layout, comm, KERNELS["cpu_flash"]))
        out["cuda"] = max(out["cuda"], kernel_launches(layout, comm, KERNELS["cuda_flash"]))
    plans = attention_plans(comm, cp, 0)  # plans of one query set merge; a2a's two do not
    out["merges"] = len(plans) - len({queries for queries, _ in plans})
    return out


def main() -> None:
    workloads = {"default packed (4 x 256)": default_batch()}
    workloads.update({f"{n} samples per row (2 x {ROW})": rows_of(n) for n in (2, 8, 32, 128)})
    print(f"# {datetime.date.today()}, torch {torch.__version__}")
    print("| rows | cp | comm | blocks (before) | cpu (after) | cuda (after) | merges (after) |")
    print("|---|---|---|---|---|---|---|")
    for name, batch in workloads.items():
        for cp, comm in [(1, None)] + [(2, c) for c in CP_ATTENTION] + [(4, "p2p")]:
            c = counts(batch, cp, comm)
            print(
                f"| {name} | {cp} | {comm or '-'} | {c['blocks']} | {c['cpu']} | {c['cuda']} "
                f"| {c['merges']} |"
            )


if __name__ == "__main__":
    main()
