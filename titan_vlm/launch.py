"""The launcher that run_train.sh execs, and what ties the workers to it.

    python -m titan_vlm.launch --config FILE [--section.key=value ...]

1. Validates the config before any process starts (one line: `config error: ...`).
2. Locks the dump folder: `<job.dump_folder>/job.lock`, an flock held by this process and
   torchrun for the whole job, restarts included. A second job on the folder stops with one line
   naming the holder (pid, host, start time, command, from the file); a lock file whose holder
   died (the kernel dropped its flock, the file still names it) is taken over with a note. A job
   that ends empties the file. (flock: one machine, or a file
   system that supports it.)
3. Starts torchrun (forked from this process, which has imported torch: `start_torchrun`) in
   its own session, so a Ctrl-C reaches only this process, and so that it dies with it
   (PR_SET_PDEATHSIG); each worker in turn exits when torchrun is gone (`die_with_parent`).
   Nothing of the job outlives the launcher.
4. SIGINT / SIGTERM: forwarded to the workers, which stop at the next step boundary (saving a
   checkpoint when checkpoint.enable), and exit 0 so that torchrun neither restarts them nor
   prints a traceback; the launcher then exits 128 + the signal. A second signal stops the workers
   at once.
5. A problem the user can fix found inside the workers (`UserError`: a dataset file that does not
   parse, no usable checkpoint, a non-finite loss, ...): the workers write its one line to the
   file named by TITAN_VLM_ERROR_FILE and exit 0 (no restart, no torchrun traceback); the
   launcher prints that line and exits 2.

Workers started without the launcher (plain torchrun) print the line from rank 0 and exit 2.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

from titan_vlm.config import (
    JobConfig,
    config_help,
    launch_shape,
    load_config,
    validate_failure_keys,
)
from titan_vlm.errors import ConfigError, UserError
from titan_vlm.process_tree import exit_after, exit_without_teardown, killed_with_parent

LOCK_FILE = "job.lock"
ERROR_FILE_ENV = "TITAN_VLM_ERROR_FILE"
LAUNCHER_PID_ENV = "TITAN_VLM_LAUNCHER_PID"


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # the command name (field 2) may hold spaces: the fields after its ')' are plain
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']} since {h['started']}: {h['command']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def lock_dump_folder(folder: Path) -> tuple[int, str | None]:
    """Create `folder` and take its job lock. Returns the lock's file descriptor (the lock lasts
    as long as it, or a copy of it, is open) and a note when a dead job's lock was taken over.
    UserError (one line) when the folder is not writable or another job holds the lock."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"job.dump_folder {folder}: cannot write there ({e.strerror})") from None
    previous = os.pread(fd, 4096, 0).decode(errors="replace")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(
            f"job.dump_folder {folder} is in use by another job ({_holder(previous)}); wait for "
            "it to end, or use another job.dump_folder"
        ) from None
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m titan_vlm.launch " + shlex.join(sys.argv[1:]),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError as e:
        os.close(fd)
        raise UserError(f"job.dump_folder {folder}: cannot write there ({e.strerror})") from None
    if previous.strip():
        return fd, f"took over {folder / LOCK_FILE} from a job that is gone ({_holder(previous)})"
    return fd, None


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (from /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ParentWatch:
    """The thread of `die_with_parent`; `stop()` ends and joins it."""

    def __init__(self, parent: int, launcher: int, poll_s: float):
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(parent, launcher, poll_s), name="die-with-parent", daemon=True
        )
        self._thread.start()

    def _watch(self, parent: int, launcher: int, poll_s: float) -> None:
        while os.getppid() == parent and (not launcher or alive(launcher)):
            if self._stopped.wait(poll_s):
                return
        if os.environ.get("RANK") == "0":
            print("[titan_vlm] the launcher or torchrun is gone: exiting", file=sys.stderr)
        os._exit(1)

    def stop(self) -> None:
        """End the thread and wait for it (a poll at most). A worker calls this last, before its
        interpreter finalizes: a Python thread still running then can abort the process
        (train.py `shut_down`)."""
        self._stopped.set()
        self._thread.join()


def die_with_parent(poll_s: float = 0.5) -> ParentWatch:
    """Exit this process (a torchrun worker) soon after its parent (torchrun) or the launcher
    (LAUNCHER_PID_ENV, set by the launcher) is gone: a killed launcher must not leave workers
    training (and writing the dump folder) as orphans. The launcher's pid also covers a worker
    whose torchrun died before this ran (its parent is then already someone else). Returns the
    watching thread's handle: the worker stops it just before it exits."""
    return ParentWatch(os.getppid(), int(os.environ.get(LAUNCHER_PID_ENV, "0")), poll_s)


class StopRequest:
    """SIGINT / SIGTERM in a worker: the first asks the training loop to stop at the next step
    boundary (`requested`), a second exits at once."""

    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is not None:
            os._exit(128 + signum)
        self.signal = signum


STOP = StopRequest()


def report_user_error(e: UserError) -> int:
    """What a worker does with a UserError; returns its exit code. Under the launcher: write the
    line to its error file and exit 0 (torchrun must neither restart the job nor print its
    traceback); else rank 0 prints the line and the worker exits 2."""
    line = f"{'config error' if isinstance(e, ConfigError) else 'error'}: {e}"
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        tmp = f"{error_file}.{os.getpid()}"
        Path(tmp).write_text(line + "\n")
        os.replace(tmp, error_file)  # every rank that raised writes the same line; one wins
        return 0
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)
    return 2


def start_torchrun(args: list[str], env: dict[str, str]) -> int:
    """torchrun (`torch.distributed.run.main(args)`) in a forked child of this launcher; its pid.

    Forked, not started: the child has torch imported already (validate_launch), which a new
    `python -m torch.distributed.run` spends 1.5 s of a core on, and it exits without the
    interpreter's teardown (exit_without_teardown), another half second. The child leads its own
    session, so a Ctrl-C at the terminal reaches the launcher alone (which forwards it to the
    workers); it is killed when the launcher dies (or has died already); its environment is
    `env`; it holds every descriptor the launcher holds, the dump folder's lock among them, and
    its workers (torchrun starts them with close_fds) none. It ends as the torchrun command
    would: 0 once every worker has, 1 with torchrun's traceback of the failed workers on stderr.
    The launcher itself is one thread until here, so the child inherits no lock held mid-use;
    the child computes nothing with torch (a CUDA context the launcher's checks made is unused)."""
    launcher = os.getpid()
    sys.stdout.flush()  # what the launcher printed must not be printed again by the child
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    # The launcher's exit handlers are not the child's: weakref.finalize's would delete the
    # launcher's temporary directory (and with it the workers' error file) when torchrun ends.
    atexit._clear()
    try:
        os.setsid()
        killed_with_parent()
        if os.getppid() != launcher:  # the launcher died before the line above
            os._exit(1)
        os.environ.clear()
        os.environ.update(env)
        from torch.distributed.run import main as torchrun

        exit_after(lambda: torchrun(args))
    except BaseException:  # never back into the launcher's code: reported as torchrun would
        traceback.print_exc()
        exit_without_teardown(1)


def validate_launch(argv: list[str], env: dict[str, str]) -> tuple[JobConfig, int, int]:
    """The config of `argv`, fully validated, with the launch's (processes per node, nodes):
    NNODES, NPROC, RDZV_ENDPOINT / NODE_RANK (config.launch_shape) against the degrees;
    ConfigError otherwise. Before any worker starts."""
    cfg = load_config(argv)
    nproc, nnodes = launch_shape(cfg, env)
    # torch (seconds to import) only once the config parses: `--help` and a mistyped key answer
    # at once
    import torch

    from titan_vlm.validate import validate_job

    validate_job(cfg, nproc * nnodes)
    validate_failure_keys(cfg)

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"{nproc} processes but {torch.cuda.device_count()} GPUs on this machine "
            "(one process per GPU; set NPROC or the degrees)"
        )
    return cfg, nproc, nnodes


def rendezvous_args(nnodes: int, env: Mapping[str, str]) -> list[str]:
    """torchrun's rendezvous: c10d at RDZV_ENDPOINT, static at NODE_RANK / MASTER_ADDR, or one
    node standalone (validate_launch checked the variables)."""
    if env.get("RDZV_ENDPOINT"):
        return [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={env['RDZV_ENDPOINT']}",
            f"--rdzv-id={env.get('RDZV_ID', 'titan_vlm')}",
        ]
    if nnodes > 1:
        return [
            f"--nnodes={nnodes}",
            f"--node-rank={env['NODE_RANK']}",
            f"--master-addr={env['MASTER_ADDR']}",
            f"--master-port={env.get('MASTER_PORT', '29500')}",
        ]
    return ["--standalone", "--nnodes=1"]


def _fail(line: str) -> None:
    print(line, file=sys.stderr)
    sys.exit(2)


def main() -> None:
    """`python -m titan_vlm.launch [--check] --config F [overrides]`; `--check`: validate only,
    then print the processes per node and job.max_restarts; `--help` (or -h): every config key
    (config.config_help)."""
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        print(config_help(), end="")
        return
    check = bool(argv) and argv[0] == "--check"
    argv = argv[1:] if check else argv
    try:
        cfg, nproc, nnodes = validate_launch(argv, dict(os.environ))
    except ConfigError as e:
        _fail(f"config error: {e}")
    if check:
        print(nproc, cfg.job.max_restarts)
        return
    lock = None
    if nnodes == 1:  # the launchers of one job on several nodes share its folder: no lock
        try:
            lock, note = lock_dump_folder(Path(cfg.job.dump_folder))
        except UserError as e:
            _fail(f"error: {e}")
        if note:
            print(f"[titan_vlm] {note}", flush=True)
    with tempfile.TemporaryDirectory(prefix="titan_vlm_") as tmp:
        error_file = Path(tmp) / "error"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # ranks share the cores
            # Restarted workers must not share the agent's rendezvous store: it can hand them a
            # dead rank's old gloo address ("connectFullMesh ... Connection refused", or a hang).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            ERROR_FILE_ENV: str(error_file),
            LAUNCHER_PID_ENV: str(os.getpid()),
        }
        agent = start_torchrun(
            [
                *rendezvous_args(nnodes, os.environ),
                f"--nproc_per_node={nproc}",
                f"--max-restarts={cfg.job.max_restarts}",
                "-m",
                "titan_vlm.train",
                *argv,
            ],
            env,
        )
        received: list[int] = []

        def forward(signum: int, frame: object) -> None:
            received.append(signum)
            workers = children(agent)
            for pid in workers:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
            if not workers:  # torchrun has not started them yet: stop torchrun itself
                os.kill(agent, signal.SIGTERM)

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        rc = os.waitstatus_to_exitcode(os.waitpid(agent, 0)[1])
        if lock is not None:  # a job that ended leaves no holder: what a later job finds is stale
            os.ftruncate(lock, 0)
        if error_file.exists():
            _fail(error_file.read_text().strip())
    if received:
        sys.exit(128 + received[0])
    sys.exit(rc)


if __name__ == "__main__":
    exit_after(main)  # with torch imported, the teardown is most of a second
