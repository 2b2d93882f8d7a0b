"""Attention and training-step throughput on one GPU (bf16): python benchmarks/gpu_throughput.py

Needs CUDA (`--dry-run` builds the rows and prints their plans on any machine). For packed rows
of 8k and 32k slots with a realistic mix (samples of 0.5k-8k slots, every other one with a
576-slot image, LLaVA-1.5's count, somewhere in its text):

1. attention: titan_vlm's planned attention (the decoder's `attention(q, k, v, layout)`,
   forward + backward, 32 heads of 128) against one FlashAttention-2 varlen call over the same
   samples in row order (the best the hardware offers for this mask: causal within each
   sample), both in ms and TFLOP/s of useful work (the visible query-key pairs). Goal: planned
   at >= 90% of the single call's throughput.
2. training step: a decoder with LLaVA-7B's widths (dim 4096, 32 heads, ffn 11008, vocab 32000)
   and `--layers` layers (4 by default, so it fits), image embeddings given, AdamW, cp = 1:
   tokens/s and MFU (model FLOPs as titan_vlm counts them, models/llava/flops.py) beside the peak
   it is measured against (`--peak-tflops`, else the device's dense bf16 peak from a table).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch
import torch.nn.functional as F

from titan_vlm.attention import attention
from titan_vlm.data.batch import Batch, Sample, collate
from titan_vlm.kernels import KERNELS
from titan_vlm.layout import build_layout
from titan_vlm.models.common.decoder import Decoder
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.parallel.cp_attention import kernel_launches

IMAGE_SLOTS = 576
HEADS, HEAD_DIM = 32, 128
# dense bf16 tensor-core peaks (TFLOP/s) by device name
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}


def packed_rows(seq_len: int, rows: int, seed: int) -> Batch:
    """Rows of `seq_len` slots packed greedily with samples of 512-8192 slots (the last one cut
    to fit); every other sample holds a 576-slot image at a random place in its text."""
    rng = random.Random(seed)
    image = torch.zeros(3, 8, 8)
    out = []
    for _ in range(rows):
        row, used = [], 0
        while used < seq_len:
            length = min(rng.randint(512, 8192), seq_len - used)
            if length > IMAGE_SLOTS + 16 and len(row) % 2 == 1:
                text = list(range(length - IMAGE_SLOTS))
                cut = rng.randint(0, len(text))
                row.append(Sample([text[:cut], image, text[cut:]]))
            else:
                row.append(Sample([list(range(length))]))
            used += length
        out.append(row)
    return collate(out, seq_len, IMAGE_SLOTS, 8, pad_id=0)


def timed(fn, repeats: int = 5) -> float:
    """Milliseconds per call of fn (after one warm-up), CUDA-synchronized."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def attention_table(seq_len: int, seed: int) -> str:
    batch = packed_rows(seq_len, 1, seed)
    _, layout = build_layout(batch.doc, batch.image)
    local = layout.slots("local")
    pairs = layout.rank_work()[0]
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, k, v = (
        torch.randn(1, HEADS, len(local), HEAD_DIM, device=dev, dtype=dt, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)

    def planned() -> None:
        out = attention(q, k, v, layout, "auto")
        torch.autograd.grad(out, (q, k, v), grad)

    # the reference: every sample one sequence, its slots in row order, causal
    doc = batch.doc[0]
    real = int((doc >= 0).sum())
    lengths = torch.unique_consecutive(doc[:real], return_counts=True)[1]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    cu = cu.to(dev)
    longest = int(lengths.max())
    qr, kr, vr = (torch.randn(real, HEADS, HEAD_DIM, device=dev, dtype=dt) for _ in range(3))
    dout = torch.randn_like(qr)
    aten = torch.ops.aten
    scale = HEAD_DIM**-0.5

    def one_call() -> None:
        out, lse, rng_state, unused, _ = aten._flash_attention_forward(
            qr, kr, vr, cu, cu, longest, longest, 0.0, True, False, scale=scale
        )
        aten._flash_attention_backward(
            dout,
            qr,
            kr,
            vr,
            out,
            lse,
            cu,
            cu,
            longest,
            longest,
            0.0,
            True,
            rng_state,
            unused,
            scale=scale,
        )

    flops = 3.5 * 4 * HEADS * HEAD_DIM * pairs  # fwd: 2 matmuls, bwd: 5 (2 FLOPs per MAC)
    ms_planned, ms_ref = timed(planned), timed(one_call)
    launches = kernel_launches(layout, None, KERNELS["cuda_flash"])
    return (
        f"| {seq_len} | {len(lengths)} | {layout.image_counts[0]} | {launches} | "
        f"{ms_planned:.2f} | {flops / ms_planned / 1e9:.0f} | {ms_ref:.2f} | "
        f"{flops / ms_ref / 1e9:.0f} | {ms_ref / ms_planned:.2f} |"
    )


def train_step_row(seq_len: int, layers: int, seed: int, peak: float) -> str:
    args = dataclasses.replace(get_flavor("llava7b").decoder, n_layers=layers)
    dev = torch.device("cuda")
    torch.manual_seed(seed)
    model = Decoder(args).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    batch = packed_rows(seq_len, 1, seed)
    index, layout = build_layout(batch.doc, batch.image)
    layout.positions = layout.positions.to(dev)
    n = layout.num_image_tokens
    tokens = torch.randint(0, args.vocab_size, index.shape, device=dev)
    labels = torch.randint(0, args.vocab_size, index.shape, device=dev)
    embeds = torch.randn(1, n, args.dim, device=dev, dtype=torch.bfloat16) if n else None

    def step() -> None:
        logits = model(tokens, embeds, layout)
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = timed(step, repeats=3)
    slots = int((batch.doc >= 0).sum())
    text = int(((batch.doc >= 0) & (batch.image < 0)).sum())
    kv = args.n_kv_heads * args.head_dim
    layer_params = 2 * args.dim * args.dim + 2 * args.dim * kv + 3 * args.dim * args.ffn_dim
    pairs = layout.rank_work()[0]
    flops = 3 * (
        2 * layers * layer_params * slots
        + layers * 4 * pairs * args.dim
        + 2 * args.dim * args.vocab_size * text
    )
    tflops = flops / ms / 1e9
    return (
        f"| {seq_len} | {layers} | {ms:.1f} | {slots / ms * 1e3:,.0f} | {tflops:.0f} | "
        f"{peak:.0f} | {tflops / peak:.1%} | {torch.cuda.max_memory_allocated() / 2**30:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="8192,32768")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--dry-run", action="store_true", help="print the rows' plans only")
    opts = parser.parse_args()
    seq_lens = [int(x) for x in opts.seq_lens.split(",")]
    if opts.dry_run:
        for seq_len in seq_lens:
            batch = packed_rows(seq_len, 1, opts.seed)
            _, layout = build_layout(batch.doc, batch.image)
            print(
                f"{seq_len} slots: {len(torch.unique(batch.doc[batch.doc >= 0]))} samples, "
                f"{layout.image_counts[0]} images, "
                f"CUDA launches {kernel_launches(layout, None, KERNELS['cuda_flash'])}, "
                f"CPU launches {kernel_launches(layout, None, KERNELS['cpu_flash'])}"
            )
        return
    name = torch.cuda.get_device_name()
    peak = opts.peak_tflops or next((p for k, p in PEAKS.items() if k in name), None)
    if peak is None:
        raise SystemExit(f"no bf16 peak known for {name!r}: pass --peak-tflops")
    print(f"# {name}, torch {torch.__version__}, bf16")
    print("\n## attention forward + backward, planned vs one varlen call (H=32, D=128)")
    print(
        "| slots | samples | images | planned launches | planned ms | TFLOP/s "
        "| one varlen call ms | TFLOP/s | planned / one call |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        print(attention_table(seq_len, opts.seed), flush=True)
    print(f"\n## training step, decoder with LLaVA-7B widths, {opts.layers} layers, cp = 1")
    print("| slots | layers | step ms | tokens/s | TFLOP/s | peak | MFU | peak mem GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        print(train_step_row(seq_len, opts.layers, opts.seed, peak), flush=True)


if __name__ == "__main__":
    main()
