#!/usr/bin/env bash
# Train titan_vlm: ./run_train.sh --config train_configs/vlm_cp.toml [--section.key=value ...]
# Starts torchrun with as many processes as the config's parallel degrees need (NPROC overrides).
set -euo pipefail
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per rank: ranks share the cores
# Validate the config (and NPROC, if set) and count processes before any worker starts:
# a bad key or an impossible layout is one line here, not a trace from every rank.
counts="$(python -m titan_vlm.config "$@")"  # fails here, under set -e, on a bad config
read -r NPROC RESTARTS <<< "$counts"
# On a failure torchrun restarts every worker (job.max_restarts times); with checkpoint.enable the
# restarted job resumes from the latest complete checkpoint. Restarted workers must not share the
# rendezvous store of torchrun's agent: it can hand them a dead rank's old gloo address
# ("connectFullMesh ... Connection refused", or a silent hang; docs: NOTES.md section 5).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" --max-restarts="$RESTARTS" -m titan_vlm.train "$@"
