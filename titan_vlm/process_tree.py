"""Processes that die with the process that started them, in a leaf module that the launcher
(torchrun under it) and the data's worker processes (loader workers, a window pass's) share."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def killed_with_parent() -> None:
    """From now on this process gets SIGKILL when its parent process dies (Linux's
    PR_SET_PDEATHSIG): torchrun under the launcher, a loader worker under its rank."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def exit_without_teardown(code: int | str | None) -> NoReturn:
    """End this process as the interpreter's own exit would, less its teardown of every module.

    Kept, in the interpreter's order: threading's exit hooks run and the other non-daemon
    threads are joined, the atexit handlers run (multiprocessing's, the logging module's),
    stdout and stderr are flushed, and `code` means what `sys.exit(code)` means (None: 0; a
    string: printed to stderr, 1).
    Skipped: freeing each module and object one by one, which in a process that imported torch
    is most of a second of a core (0.5 to 0.8 s, Python 3.11 on a 2-core Xeon, 2026-12-06),
    paid by the launcher, torchrun and every worker at each job's end and restart. Only for a
    process's own entry point, once the entry has closed what it opened: a file that only a
    finalizer would flush is not flushed."""
    # What Py_FinalizeEx calls first: threading's own exit hooks (concurrent.futures' ends the
    # idle threads of executors never shut down, such as inductor's compile pool; joining
    # them without it waits forever), then a join of every non-daemon thread.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(status)


def exit_after(main: Callable[[], object]) -> NoReturn:
    """Run a process's entry point `main`, then `exit_without_teardown` with the code of the
    SystemExit it raised (0 when it returns). Any other exception propagates as it would."""
    try:
        main()
    except SystemExit as e:
        exit_without_teardown(e.code)
    exit_without_teardown(0)
