"""Qwen2.5-VL's vision tower on packed native-resolution images, titan_vlm against transformers:

    python benchmarks/qwen_vit.py [--quick] [--configs debug,wide]

titan_vlm's `VisionTower` (titan_vlm/models/qwen2_5_vl/vision.py) and transformers' own
`Qwen2_5_VisionTransformerPretrainedModel` (what `Qwen2_5_VLForConditionalGeneration.model.visual`
is; its CPU default attention, "sdpa") with the same weights (transformers' model built from a
config and perturbed off its initial values, its tensors copied into ours under the names of
titan_vlm/models/qwen2_5_vl/hf_adapter.py `export_names`, its fused qkv cut into our q, k, v), on
the same pixel_values and grid_thw: three images and one video packed into one sequence (GRIDS,
in patches), random pixels, fp32, CPU.

Per configuration and implementation:

  images/s         grids (3 images + 1 video) per second: median of the timed repeats, after a
                   warm-up, ours and theirs interleaved; forward under no_grad, and forward +
                   backward of (out * g).sum() into every parameter
  max rel diff     max |a - b| / max |b| of the embeddings and (the largest over the
                   parameters) of the gradients after one backward of (out * g).sum(): ours from
                   theirs (embeddings asserted < 1e-5), and each from a float64 copy of theirs
  attention calls  per ViT block, window blocks / full-attention blocks: ours, calls of the
                   attention entry point (`planned_attention`, i.e. `_PlannedAttention.apply`);
                   theirs, calls of torch.nn.functional.scaled_dot_product_attention (its sdpa
                   attention interface, called once per cu_seqlens chunk: a loop over windows or
                   frames when flash-attention is not installed)
  kernel calls     per ViT block, window / full blocks: aten attention kernel invocations seen
                   by a TorchDispatchMode, forward and backward (ours: one per packed sequence of
                   the plan, cross-checked against the calls of kernels.CpuFlash.block and
                   block_backward)

Counts come from one extra forward + backward per implementation, outside the timed repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.nn as nn
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)

from titan_vlm import attention as titan_attention
from titan_vlm.kernels import CpuFlash
from titan_vlm.models.common.hf_adapter import hf_tensor_parts
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs, VisionArgs
from titan_vlm.models.common.text_args import DecoderArgs
from titan_vlm.models.qwen2_5_vl.hf_adapter import export_names
from titan_vlm.models.qwen2_5_vl.vision import VisionTower

# (t, h, w) in patches: three images and one video of 4 temporal patches (8 frames)
GRIDS = [(1, 16, 22), (1, 32, 24), (1, 20, 20), (4, 16, 16)]
TOL = 1e-5  # embeddings, ours against theirs (fp32)
GRAD_TOL = 1e-4
CONFIGS: dict[str, VisionArgs] = {
    "debug": VisionArgs(),  # the "debug" flavor's tower: 4 x 32, windows of 2x2 merge units
    "wide": VisionArgs(
        depth=8,
        hidden_size=256,
        num_heads=4,
        intermediate_size=512,
        window_size=112,  # windows of 4x4 merge units (8x8 patches)
        fullatt_block_indexes=(3, 7),
        out_hidden_size=256,
    ),
}


def hf_vision_config(a: VisionArgs) -> Qwen2_5_VLVisionConfig:
    return Qwen2_5_VLVisionConfig(
        depth=a.depth,
        hidden_size=a.hidden_size,
        num_heads=a.num_heads,
        intermediate_size=a.intermediate_size,
        hidden_act=a.hidden_act,
        patch_size=a.patch_size,
        temporal_patch_size=a.temporal_patch_size,
        spatial_merge_size=a.spatial_merge_size,
        window_size=a.window_size,
        fullatt_block_indexes=list(a.fullatt_block_indexes),
        out_hidden_size=a.out_hidden_size,
        in_channels=a.in_channels,
    )


def vision_names(a: VisionArgs) -> dict[str, str]:
    """{VisionTower parameter: transformers vision-model parameter}, from hf_adapter's names of a
    whole model around this tower (its decoder only names parameters, and is never built)."""
    out = a.out_hidden_size
    decoder = DecoderArgs(
        dim=out, n_layers=1, n_heads=out // 16, n_kv_heads=out // 16, ffn_dim=out, qkv_bias=True
    )
    names = export_names(Qwen25VLArgs(vision=a, decoder=decoder, mrope_section=(2, 3, 3)))
    return {
        ours.removeprefix("vision."): theirs.removeprefix("visual.")
        for ours, theirs in names.items()
        if ours.startswith("vision.")
    }


def ours_from_theirs(
    state: dict[str, torch.Tensor], names: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Our tensors from transformers' (a fused qkv cut into our q, k, v: hf_tensor_parts)."""
    out = {}
    for theirs, parts in hf_tensor_parts(names).items():
        out.update(zip(parts, state[theirs].chunk(len(parts))))
    return out


def build(a: VisionArgs, seed: int = 0) -> tuple[VisionTower, nn.Module, dict[str, str]]:
    """transformers' tower (perturbed off its initial values, so that a bias or norm not loaded
    shows) and ours with its weights."""
    torch.manual_seed(seed)
    theirs = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        hf_vision_config(a), attn_implementation="sdpa"
    )
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    names = vision_names(a)
    state = theirs.state_dict()
    assert set(names.values()) == set(state), set(names.values()) ^ set(state)
    ours = VisionTower(a, "auto")
    ours.load_state_dict(ours_from_theirs(state, names), strict=True)
    return ours.train(), theirs.train(), names


def pixels(a: VisionArgs, grids: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grids.prod(-1).sum()), a.patch_dim, generator=g)


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@contextlib.contextmanager
def counting(target: Any, attr: str, counter: Counter[str], key: Callable[[], str]) -> Iterator:
    """Patch target.attr with a wrapper that adds one to counter[key()] per call."""
    original = getattr(target, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counter[key()] += 1
        return original(*args, **kwargs)

    with mock.patch.object(target, attr, wrapper):
        yield


@contextlib.contextmanager
def block_tracker(blocks: nn.ModuleList) -> Iterator[list[str]]:
    """current[0] is "fwd i" / "bwd i" while block i runs its forward / backward."""
    current = ["outside"]
    handles = []
    for i, block in enumerate(blocks):

        def fwd(*_: Any, i: int = i) -> None:
            current[0] = f"fwd {i}"

        def bwd(*_: Any, i: int = i) -> None:
            current[0] = f"bwd {i}"

        handles.append(block.register_forward_pre_hook(fwd))
        handles.append(block.register_full_backward_pre_hook(bwd))
    try:
        yield current
    finally:
        for h in handles:
            h.remove()


def per_block(counter: Counter[str], a: VisionArgs, phase: str) -> str:
    """'window / full': the counts of one window block and one full-attention block (asserted the
    same over the blocks of each kind)."""
    kinds = {True: set(), False: set()}  # full?: the counts seen
    for i in range(a.depth):
        kinds[i in a.fullatt_block_indexes].add(counter[f"{phase} {i}"])
    assert counter[f"{phase} outside"] == 0, counter
    assert all(len(v) <= 1 for v in kinds.values()), kinds
    shown = [str(next(iter(kinds[full]))) if kinds[full] else "-" for full in (False, True)]
    return " / ".join(shown)


class KernelsPerBlock(TorchDispatchMode):
    """Counts aten attention kernels (forward and backward) per block of a block tracker
    ("fwd i" / "bwd i"; a kernel of the other phase, or outside any block, as "... outside"), and
    per aten op name."""

    def __init__(self, current: list[str]) -> None:
        super().__init__()
        self.current = current
        self.calls: Counter[str] = Counter()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if "attention" in name or "scaled_dot_product" in name:
            phase, _, block = self.current[0].partition(" ")
            want = "bwd" if "backward" in name else "fwd"
            self.calls[f"{want} {block}" if phase == want else f"{want} outside"] += 1
            self.names[name] += 1
        return func(*args, **kwargs or {})


def count_calls(
    ours: VisionTower, theirs: nn.Module, x: torch.Tensor, grids: torch.Tensor, a: VisionArgs
) -> dict[str, dict[str, str]]:
    """One forward + backward of each, counting attention entry points and kernels per block."""
    result = {}
    for name, model, blocks in (
        ("titan_vlm", ours, ours.layers),
        ("transformers", theirs, theirs.blocks),
    ):
        entry: Counter[str] = Counter()
        loop: Counter[str] = Counter()
        with contextlib.ExitStack() as stack:
            current = stack.enter_context(block_tracker(blocks))

            def at(current: list[str] = current) -> str:
                return current[0]

            if model is ours:
                attn = titan_attention._PlannedAttention
                stack.enter_context(counting(attn, "apply", entry, at))
                stack.enter_context(counting(CpuFlash, "block", loop, at))
                stack.enter_context(counting(CpuFlash, "block_backward", loop, at))
            else:
                sdpa = "scaled_dot_product_attention"
                stack.enter_context(counting(torch.nn.functional, sdpa, entry, at))
            mode = stack.enter_context(KernelsPerBlock(current))
            model.zero_grad(set_to_none=True)
            forward(model, x, grids).sum().backward()
        if model is ours:  # one aten kernel per call of the CPU kernel's block op
            assert loop == mode.calls, (loop, mode.calls)
        result[name] = {
            "entry": per_block(entry, a, "fwd"),
            "fwd": per_block(mode.calls, a, "fwd"),
            "bwd": per_block(mode.calls, a, "bwd"),
            "kernels": ", ".join(f"{k} x{n}" for k, n in sorted(mode.names.items())),
        }
    return result


def forward(model: nn.Module, x: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, VisionTower):
        return model(x, grids)
    return model(x, grid_thw=grids).pooler_output


def check_exact(
    ours: VisionTower,
    theirs: nn.Module,
    names: dict[str, str],
    x: torch.Tensor,
    grids: torch.Tensor,
) -> dict[str, tuple[float, float]]:
    """Max relative differences (embeddings, largest over the parameters' gradients) of ours and
    theirs from theirs in fp32 and from a float64 copy of theirs, after one forward and a
    backward of (out * g).sum()."""
    reference = copy.deepcopy(theirs).double()
    g = torch.Generator().manual_seed(2)
    units = int(grids.prod(-1).sum()) // ours.args.merge_unit
    dout = torch.randn(units, ours.args.out_hidden_size, generator=g, dtype=torch.float64)
    outs, grads = {}, {}
    for name, model in (("ours", ours), ("theirs", theirs), ("fp64", reference)):
        model.zero_grad(set_to_none=True)
        out = forward(model, x.to(dout.dtype) if model is reference else x, grids)
        (out * dout.to(out.dtype)).sum().backward()
        params = dict(model.named_parameters())
        outs[name] = out.detach().double()
        grads[name] = {  # by transformers' tensor (ours: its parts concatenated)
            t: torch.cat([params[o].grad for o in parts]).double()
            if model is ours
            else params[t].grad.double()
            for t, parts in hf_tensor_parts(names).items()
        }

    def diff(a: str, b: str) -> tuple[float, float]:
        grad = max(rel(grads[a][t], grads[b][t]) for t in grads[a])
        return rel(outs[a], outs[b]), grad

    return {
        "ours vs theirs": diff("ours", "theirs"),
        "ours vs fp64": diff("ours", "fp64"),
        "theirs vs fp64": diff("theirs", "fp64"),
    }


def throughput(
    ours: VisionTower,
    theirs: nn.Module,
    x: torch.Tensor,
    grids: torch.Tensor,
    warmup: int,
    repeats: int,
) -> dict[str, dict[str, float]]:
    """Median seconds of forward (no_grad) and forward + backward, ours and theirs interleaved."""
    units = int(grids.prod(-1).sum()) // ours.args.merge_unit
    dout = torch.randn(units, ours.args.out_hidden_size, generator=torch.Generator().manual_seed(3))
    times: dict[str, dict[str, list[float]]] = {
        n: {"fwd": [], "fwd+bwd": []} for n in ("titan_vlm", "transformers")
    }

    def fwd(model: nn.Module) -> None:
        with torch.no_grad():
            forward(model, x, grids)

    def fwd_bwd(model: nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        (forward(model, x, grids) * dout).sum().backward()

    for r in range(warmup + repeats):
        for name, model in (("titan_vlm", ours), ("transformers", theirs)):
            for phase, step in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                start = time.perf_counter()
                step(model)
                if r >= warmup:
                    times[name][phase].append(time.perf_counter() - start)
    return {n: {p: statistics.median(t) for p, t in d.items()} for n, d in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 warm-up, 2 timed repeats")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="of: " + ", ".join(CONFIGS))
    args = parser.parse_args()
    warmup, repeats = (1, 2) if args.quick else (2, 7)
    grids = torch.tensor(GRIDS)
    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    print(
        f"{date}; {platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, transformers {transformers.__version__}; grids (t, h, w) {GRIDS}, "
        f"{int(grids.prod(-1).sum())} patches; {warmup} warm-up + {repeats} timed repeats; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    rows = []
    for cfg in args.configs.split(","):
        a = CONFIGS[cfg]
        ours, theirs, names = build(a)
        x = pixels(a, grids)
        diffs = check_exact(ours, theirs, names, x, grids)
        err, grad_err = diffs["ours vs theirs"]
        assert err < TOL, f"{cfg}: embeddings differ by {err:.2e} (relative) >= {TOL}"
        # a sanity bound (a weight loaded wrong shows as O(1)); the table prints the values
        assert grad_err < GRAD_TOL, f"{cfg}: gradients differ by {grad_err:.2e} >= {GRAD_TOL}"
        counts = count_calls(ours, theirs, x, grids, a)
        secs = throughput(ours, theirs, x, grids, warmup, repeats)
        shape = (
            f"{cfg}: depth {a.depth}, hidden {a.hidden_size}, {a.num_heads} heads, "
            f"window {a.window_size} px, full {a.fullatt_block_indexes}"
        )
        for name in ("titan_vlm", "transformers"):
            c, s = counts[name], secs[name]
            ours_row = name == "titan_vlm"
            diff = "{:.1e} / {:.1e}".format(*diffs["ours vs theirs"]) if ours_row else "-"
            fp64 = "{:.1e} / {:.1e}".format(
                *diffs["ours vs fp64" if ours_row else "theirs vs fp64"]
            )
            rows.append(
                f"| {shape} | {name} | {len(GRIDS) / s['fwd']:.1f} | "
                f"{len(GRIDS) / s['fwd+bwd']:.1f} | {diff} | {fp64} | {c['entry']} | {c['fwd']} | "
                f"{c['bwd']} |"
            )
            print(f"  {cfg} {name}: aten attention kernels (fwd + bwd, all blocks): {c['kernels']}")
    print()
    print(
        "| config | implementation | fwd images/s | fwd+bwd images/s "
        "| max rel diff from transformers fp32 (out / grads) "
        "| max rel diff from transformers fp64 (out / grads) "
        "| attention calls per block (window / full) | kernel calls per block fwd (window / full) "
        "| kernel calls per block bwd (window / full) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
