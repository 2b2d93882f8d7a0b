#!/usr/bin/env bash
# Train titan_vlm: ./run_train.sh --config train_configs/vlm_cp.toml [--section.key=value ...]
# Starts torchrun with as many processes as the config's parallel degrees need (NPROC overrides).
set -euo pipefail
# Validate the config and count processes before starting any worker (one-line errors).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per rank: ranks share the cores
NPROC="${NPROC:-$(python -m titan_vlm.config "$@")}"
exec torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" -m titan_vlm.train "$@"
