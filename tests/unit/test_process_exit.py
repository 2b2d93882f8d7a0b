"""exit_without_teardown (the launcher's, torchrun's and each worker's way out): everything the
interpreter's own exit does before its module teardown, in the same order, with the same code."""

import subprocess
import sys
import textwrap

import pytest

# A process with a non-daemon thread still working, an idle executor's thread, an atexit handler
# that records which threads are alive, and unflushed text on stdout, that ends with
# exit_without_teardown(code).
PROGRAM = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from titan_vlm.process_tree import exit_without_teardown

    done = []
    worker = threading.Thread(target=lambda: (time.sleep(0.2), done.append(1)), name="writer")
    worker.start()
    # an executor never shut down (inductor's compile pool is one): its idle thread waits for
    # the interpreter's exit hook, a join alone waits forever
    from concurrent.futures import ThreadPoolExecutor
    executor = ThreadPoolExecutor(2)  # held: a collected executor would end its threads itself
    executor.submit(int).result()
    atexit.register(lambda: print("atexit", len(done), threading.active_count(), flush=True))
    sys.stdout.write("unflushed ")  # no newline, no flush
    exit_without_teardown({code})
    print("never")
    """
)


@pytest.mark.parametrize(
    "code, status, stderr", [("0", 0, ""), ("None", 0, ""), ("3", 3, ""), ("'why'", 1, "why\n")]
)
def test_exit_joins_threads_runs_atexit_flushes_and_means_what_sys_exit_means(code, status, stderr):
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(code=code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == status
    # the thread had finished (joined) when the handler ran, and was the last one but main
    assert done.stdout == "unflushed atexit 1 1\n"
    assert done.stderr == stderr
