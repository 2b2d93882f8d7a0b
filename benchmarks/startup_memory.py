"""Peak resident memory per rank at start-up, by FSDP shard count:

    python benchmarks/startup_memory.py [--shards 1,2,4] [--layers 16] [--dim 1024]

Writes (once, under --folder) a Hugging Face LLaVA folder with random bf16 weights of a few
hundred million parameters (a small SigLIP tower, a Llama decoder of --layers x --dim), then,
for each shard count N, starts N gloo processes on a dp_shard=N mesh that build the trainer's
model from it (models/build.py: meta device, FSDP, each rank reads its own boxes of the file)
and report the peak resident set of the worst rank, beside the same processes building the
whole model first (the old way: every rank holds every weight, then FSDP shards it).
Peak RSS includes the Python + torch baseline, printed as the "empty" row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _group import run_group  # noqa: E402


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def llava_config(layers: int, dim: int) -> dict:
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": 31999,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "tie_word_embeddings": False,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "image_size": 64,
            "patch_size": 8,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh",
        },
        "text_config": {
            "model_type": "llama",
            "hidden_size": dim,
            "intermediate_size": 4 * dim,
            "num_hidden_layers": layers,
            "num_attention_heads": dim // 64,
            "num_key_value_heads": dim // 64,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
    }


def write_folder(folder: Path, layers: int, dim: int) -> None:
    """A LLaVA folder with random weights (bf16)."""
    from safetensors.torch import save_file

    from titan_vlm.models.hf_export import hf_config
    from titan_vlm.models.registry import model_spec

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(llava_config(layers, dim), indent=1))
    cfg = hf_config(str(folder))
    spec = model_spec(cfg)
    args = spec.args(cfg)
    with torch.device("meta"):
        model = spec.build(args)
    names = spec.hf_export_names(args)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        names[n]: (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
        for n, p in model.named_parameters()
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def worker(rank: int, size: int, results, folder: str, how: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titan_vlm.models.build import build_model
    from titan_vlm.models.hf_export import hf_config
    from titan_vlm.models.registry import model_spec
    from titan_vlm.parallel_dims import Mesh

    root = init_device_mesh(
        "cpu", (1, 1, size, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp")
    )
    mesh = Mesh.from_root(root)
    cfg = hf_config(folder)
    spec = model_spec(cfg)
    begin = time.perf_counter()
    if how == "sharded":
        build_model(spec, cfg, mesh, torch.device("cpu"))
    elif how == "whole first":  # every rank materialises every weight, then FSDP shards it
        from titan_vlm.models.hf_export import load_hf_model

        model, _ = load_hf_model(cfg)
        spec.parallelize(model, mesh, cfg)
    seconds = time.perf_counter() - begin
    peak = torch.tensor([peak_rss_gib()])
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        results.put({"how": how, "shards": size, "peak_gib": float(peak), "seconds": seconds})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="1,2,4")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--folder", default="/tmp/titan_vlm_startup_bench")
    parser.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    folder = Path(opts.folder) / f"l{opts.layers}_d{opts.dim}"
    if opts.write_only:
        write_folder(folder, opts.layers, opts.dim)
        return
    if not (folder / "model.safetensors").is_file():
        # in a process of its own: Linux keeps a process's peak RSS across fork and exec, so
        # the workers started below would inherit this one's peak from writing the weights
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--write-only"], check=True)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        count = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    print(
        f"# {count / 1e6:.0f}M parameters ({count * 4 / 2**30:.2f} GiB in fp32), "
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores"
    )
    print("| FSDP shards | how | peak RSS, worst rank (GiB) | build time (s) |")
    print("|---|---|---|---|")
    for size in [int(s) for s in opts.shards.split(",")]:
        for how in ("empty", "whole first", "sharded"):
            (r,) = run_group(worker, size, 1, str(folder), how)
            print(f"| {size} | {how} | {r['peak_gib']:.2f} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
