#!/usr/bin/env bash
# Train titan_vlm: ./run_train.sh --config train_configs/vlm_cp.toml [--section.key=value ...]
# The launcher (titan_vlm/launch.py) validates the config and the launch (a bad key or an
# impossible layout is one line here, not a trace from every rank), locks job.dump_folder, and
# starts torchrun with as many processes as the config's parallel degrees need (NPROC overrides).
# On a failure torchrun restarts every worker (job.max_restarts times); with checkpoint.enable
# the restarted job resumes from the newest verified checkpoint.
# More than one node (docs/scaling.md): run the same command on every node with
#   NNODES=N NPROC=<processes per node> RDZV_ENDPOINT=<host:port>   (torchrun's c10d rendezvous)
# or NNODES=N NPROC=... NODE_RANK=<0..N-1> MASTER_ADDR=<node 0> [MASTER_PORT=29500]  (static).
set -euo pipefail
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per rank: ranks share the cores
# Restarted workers must not share the rendezvous store of torchrun's agent: it can hand them a
# dead rank's old gloo address ("connectFullMesh ... Connection refused", or a silent hang;
# NOTES.md section 5). The launcher sets it for torchrun too.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec python -m titan_vlm.launch "$@"
