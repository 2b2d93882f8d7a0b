#!/usr/bin/env bash
# Train titan_vlm: ./run_train.sh --config train_configs/vlm_cp.toml [--section.key=value ...]
# Starts torchrun with as many processes as the config's parallel degrees need (NPROC overrides).
# More than one node (README "Scaling out"): run the same command on every node with
#   NNODES=N NPROC=<processes per node> RDZV_ENDPOINT=<host:port>   (torchrun's c10d rendezvous)
# or NNODES=N NPROC=... NODE_RANK=<0..N-1> MASTER_ADDR=<node 0> [MASTER_PORT=29500]  (static).
set -euo pipefail
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per rank: ranks share the cores
# Validate the config and the launch (NNODES, NPROC, ... against the degrees) and count processes
# before any worker starts: a bad key or an impossible layout is one line here, not a trace from
# every rank.
counts="$(python -m titan_vlm.config "$@")"  # fails here, under set -e, on a bad config
read -r NPROC RESTARTS <<< "$counts"
NNODES="${NNODES:-1}"
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    launch=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
            --rdzv-id="${RDZV_ID:-titan_vlm}")
elif (( NNODES > 1 )); then
    launch=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR"
            --master-port="${MASTER_PORT:-29500}")
else
    launch=(--standalone --nnodes=1)
fi
# On a failure torchrun restarts every worker (job.max_restarts times); with checkpoint.enable the
# restarted job resumes from the latest complete checkpoint.
exec torchrun "${launch[@]}" --nproc-per-node="$NPROC" --max-restarts="$RESTARTS" \
    -m titan_vlm.train "$@"
