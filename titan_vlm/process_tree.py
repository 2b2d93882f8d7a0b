"""Processes that die with the process that started them, in a leaf module that the launcher
(torchrun under it) and the data's worker processes (loader workers, a window pass's) share."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def killed_with_parent() -> None:
    """From now on this process gets SIGKILL when its parent process dies (Linux's
    PR_SET_PDEATHSIG): torchrun under the launcher, a loader worker under its rank."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
