"""The hardware the planner prices a layout on: one small table, each figure with its source.

`peak_flops` is the dense (no sparsity) bf16 tensor-core rate; fp32 runs are priced at
`peak_flops_fp32`. `intra_gbps` is one GPU's NVLink bandwidth in one direction (the vendor quotes
the bidirectional total, twice this); `inter_gbps` is one GPU's share of the node's network (one
NIC per GPU on the DGX systems below), in GB/s. HBM is the capacity per GPU in GiB as sold
(decimal GB converted).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_vlm.config import ConfigError


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    peak_flops_fp32: float  # fp32 (TF32 off) FLOP/s per device
    hbm_gib: float  # memory per device
    intra_gbps: float  # GB/s per device, one direction, inside a node
    inter_gbps: float  # GB/s per device, one direction, between nodes
    gpus_per_node: int
    source: str


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100",
        989e12,
        67e12,
        80e9 / 2**30,
        450.0,
        50.0,
        8,
        "NVIDIA H100 SXM5 datasheet (989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 80 GB HBM3, NVLink "
        "900 GB/s bidirectional); DGX H100 user guide (8x ConnectX-7 400 Gb/s, one per GPU)",
    ),
    "h200": Hardware(
        "h200",
        989e12,
        67e12,
        141e9 / 2**30,
        450.0,
        50.0,
        8,
        "NVIDIA H200 SXM datasheet (989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 141 GB HBM3e, NVLink "
        "900 GB/s bidirectional); DGX H200 user guide (8x ConnectX-7 400 Gb/s, one per GPU)",
    ),
    "a100": Hardware(
        "a100",
        312e12,
        19.5e12,
        80e9 / 2**30,
        300.0,
        25.0,
        8,
        "NVIDIA A100 SXM4 80GB datasheet (312 TFLOP/s dense bf16, 19.5 TFLOP/s fp32, NVLink 600 "
        "GB/s bidirectional); DGX A100 user guide (8x ConnectX-6 200 Gb/s HDR, one per GPU)",
    ),
    "cpu": Hardware(
        "cpu",
        # one core of this project's CPU machine (AMD EPYC, AVX-512, about 2.6 GHz): 2 x 16 fp32
        # FMA lanes = 64 FLOP/cycle; bf16 is not faster through aten's CPU kernels
        166e9,
        166e9,
        24.0 / 2,
        5.0,
        5.0,
        2,
        "this project's CPU machine (lscpu: 2 EPYC cores with AVX-512; free: 24 GiB, shared by "
        "the 2 ranks a node runs; gloo over loopback, a few GB/s): a rough figure for "
        "checking plans on the machine the tests run on, not a datasheet",
    ),
}


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ConfigError(f"--gpu: unknown hardware {name!r} (known: {', '.join(HARDWARE)})")
    return HARDWARE[name]
