"""Where a dataset's records lie, kept between runs (`data.cache_index`, data/jsonl.py): the scan
that finds each record's line and byte span (every line of a JSONL file, every member header of a
tar) runs once; a restart, a resume or another run of the same files maps the spans instead
(memory-mapped: the ranks of a node share its pages). Nothing a record becomes (its tokens, its
images' sizes) is kept: a window's pass parses that when training reaches it (data/windows.py).

    <job.dump_folder>/data_index/<key>/arrays.bin   3 x n int64: lines, starts, ends
                                      /meta.json    each file's record count, the arrays' size
                                                    and SHA-256
                                /digest-<key>.txt   the files' content digest (resume_config's
                                                    fact), kept by the same files' identity

Invariants: the key covers what decides the spans (`index_key`: titan_vlm's own code and each
dataset file's path, size and modification time), so cached spans are the ones the scan would
find; a cache that does not match its own digest, or cannot be read, is passed over with a
warning and scanned again (`load` never raises: every rank must reach IndexShare.agree); a cache
is written whole or not at all (a folder renamed into place), by one rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import tempfile
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_vlm.data.json_spans import Spans

logger = logging.getLogger("titan_vlm")

VERSION = 2  # of the files' layout (1: the whole parsed index, before windows)
INDEX_FOLDER = "data_index"  # in job.dump_folder (`index_folder`)
DIGEST = re.compile(r"(\d+ files, )?\d+ bytes, [0-9a-f]{16}")  # resume_config.data_digest's
ARRAYS = ("lines", "starts", "ends")  # Spans' arrays, every file's records in turn
CODE = Path(__file__).resolve().parents[1]  # titan_vlm/: its code decides where records lie


@dataclass(frozen=True)
class IndexCache:
    """Where a dataset keeps its records' spans between runs, and what of the run decides them
    besides the files (the trainer's `settings`: titan_vlm's code; JSON-able)."""

    folder: Path
    settings: dict[str, Any] = field(default_factory=dict, hash=False)


def cached_digest(folder: Path, files: list[Path], compute: Callable[[], str]) -> str:
    """`compute()` (the data files' content digest: resume_config.data_digest), kept in `folder`
    under the files' paths, sizes and modification times: a restart of a run on a large corpus
    does not hash it again while no file changes. A digest that cannot be written is computed
    again next time (a warning)."""
    key = index_key({"digest": 1, "names": [f.name for f in files]}, files)
    path = folder / f"digest-{key}.txt"
    try:
        kept = path.read_text()
        if DIGEST.fullmatch(kept):
            return kept
    except (OSError, ValueError):  # not there, unreadable, not UTF-8: hashed again
        pass
    digest = compute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{path.name}.{os.getpid()}"
        tmp.write_text(digest)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("data: %s not written (%s): the next start hashes the data again", path, e)
    return digest


def index_folder(dump_folder: str) -> Path:
    """Where a run keeps its data's index and digest between runs: <job.dump_folder>/data_index."""
    return Path(dump_folder) / INDEX_FOLDER


def code_digest() -> str:
    """SHA-256 of titan_vlm's Python files (their names and bytes): any change of the code that
    parses, tokenizes and sizes records makes a new key."""
    h = hashlib.sha256()
    for path in sorted(CODE.rglob("*.py")):
        h.update(f"{path.relative_to(CODE).as_posix()}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def index_key(settings: dict[str, Any], files: list[Path]) -> str:
    """The cache key of a dataset's index: `settings` (what else decides it: the caller's model
    and config, JSON-able) and each file's resolved path, size and modification time."""
    stats = [[str(f.resolve()), *identity(str(f))] for f in files]
    text = json.dumps({"version": VERSION, "settings": settings, "files": stats}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def identity(path: str) -> list[int]:
    """A file's size and modification time; [-1, -1] where it is not there (or not a file)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # ValueError: a name no file can have (a NUL, a surrogate)
        return [-1, -1]
    return [st.st_size, st.st_mtime_ns] if stat.S_ISREG(st.st_mode) else [-1, -1]


def save(folder: Path, key: str, spans: list[Spans]) -> None:
    """Write each dataset file's `spans` as key's cache in `folder` (in place of one there). A
    failure to write (a full disk, a read-only folder) is a warning: the run goes on without it."""
    final = folder / key
    tmp: Path | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()  # the umask's mode (mkdtemp's is the owner's alone)
        digest = hashlib.sha256()
        with open(tmp / "arrays.bin", "wb") as f:
            for name in ARRAYS:
                for file_spans in spans:
                    raw = array("q", getattr(file_spans, name)).tobytes()
                    digest.update(raw)
                    f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        meta = {
            "version": VERSION,
            "records": [len(file_spans) for file_spans in spans],
            "arrays_sha256": digest.hexdigest(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        if final.exists():  # one some rank could not use (unreadable, damaged, not seen there)
            old = Path(tempfile.mkdtemp(prefix=f".{key}-old-", dir=folder))
            os.replace(final, old / key)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, final)  # whole or not at all
        except OSError:
            if not (final / "meta.json").is_file():
                raise
            # another run wrote the same key meanwhile: the same spans, theirs stays
        else:
            tmp = None
    except Exception as e:  # noqa: BLE001 - the cache is an optimisation: never stop the run
        logger.warning("data: index cache %s not written (%s): the next run scans again", final, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load(folder: Path, key: str) -> list[Spans] | None:
    """Key's cached spans in `folder` (each file's; their arrays memory-mapped); None where there
    are none, or (with a warning) where they cannot be read or do not match their digest. It
    never raises: every rank must reach IndexShare.agree."""
    where = folder / key
    try:
        if not (where / "meta.json").is_file():
            return None
        meta = json.loads((where / "meta.json").read_text())
        counts = [int(n) for n in meta["records"]]
        n = sum(counts)
        with open(where / "arrays.bin", "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if n else b""
        if meta["version"] != VERSION or len(mapped) != len(ARRAYS) * n * 8:
            raise ValueError(f"{len(mapped)} bytes of arrays for {n} records")
        if hashlib.sha256(mapped).hexdigest() != meta["arrays_sha256"]:
            raise ValueError("arrays.bin does not match its SHA-256")
        view = memoryview(mapped).cast("q") if n else memoryview(array("q"))
        arrays = [view[k * n : (k + 1) * n] for k in range(len(ARRAYS))]
        out, at = [], 0
        for count in counts:
            spans = Spans()
            # read-only views of the mapped file stand in for the arrays a scan appends to
            spans.lines, spans.starts, spans.ends = (a[at : at + count] for a in arrays)  # type: ignore[assignment]
            out.append(spans)
            at += count
        return out
    except Exception as e:  # noqa: BLE001 - unreadable in any way: scanned again, on every rank
        logger.warning("data: index cache %s unusable (%s): scanning the files again", where, e)
        return None
