"""Run one of titan_vlm's command-line entry points the way a user does: a fresh
`python -m <module> <argv>` process (this interpreter), its output captured as text."""

from __future__ import annotations

import subprocess
import sys


def python_m(module: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m <module> <argv>`; the exit code, stdout and stderr in the result."""
    return subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout
    )
