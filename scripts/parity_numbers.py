"""Print, as one JSON line, the numbers a refactor must not change: the parity check's losses,
grad norms and per-group errors for a few layouts (two negative controls among them) and four
steps of the real training loop, from the checkout on PYTHONPATH (its tests/dist_checks.py):

    PYTHONPATH=/path/to/a python scripts/parity_numbers.py > a.json
    PYTHONPATH=/path/to/b python scripts/parity_numbers.py > b.json
    python -c "import json; print(json.load(open('a.json')) == json.load(open('b.json')))"
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "tests"))

from dist_pool import DistPool  # noqa: E402

CASES = [
    {"comm": "p2p", "cp": 2},
    {"comm": "a2a", "cp": 2, "vision": "broadcast"},
    {"cp": 2, "vision": "replicate", "images": 2},
    {"comm": "p2p", "cp": 2, "sum_image_grad": False},
    {"cp": 2, "vision": "broadcast", "sum_image_grad": False},
    {"cp": 2, "tp": 2, "sp": True, "image_embed_tp_shard": True},
]
STEP_KEYS = ("step", "loss", "grad_norm", "lr", "ntokens", "cp_balance")

if __name__ == "__main__":
    pool = DistPool(4)
    out: dict[str, object] = {}
    for case in CASES:
        out[json.dumps(case, sort_keys=True)] = pool.run("parity", seq_len=61, **case)[0]
    history = pool.run(
        "train_run",
        dp_shard=1,
        cp=2,
        steps=4,
        job__dump_folder=tempfile.mkdtemp(),
        training__seq_len=61,
        training__local_batch_size=2,
        metrics__enable_tensorboard=False,
    )[0]
    out["train_run"] = [{k: h[k] for k in STEP_KEYS} for h in history]
    pool.close()
    print(json.dumps(out, sort_keys=True, default=str))
