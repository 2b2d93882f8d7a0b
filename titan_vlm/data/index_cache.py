"""A dataset's start-up index kept between runs (`data.cache_index`, data/jsonl.py): the pass that
parses and tokenizes every record runs once; a restart, a resume or another run of the same data
and model maps the index instead (memory-mapped: the ranks of a node share its pages).

    <job.dump_folder>/data_index/<key>/arrays.bin   5 x n int64: lines, files, starts, ends, sizes
                                      /meta.json    counters, bad-sample reports, video headers,
                                                    the arrays' size and SHA-256
                                /digest-<key>.txt   the files' content digest (resume_config's
                                                    fact), kept by the same files' identity

Invariants: the key covers what decides the index besides the image files (`index_key`:
titan_vlm's own code, what the tokenizer and processor do, the arguments that size a sample,
and each dataset file's path, size and modification time), and the image, frame and video files
the records name are stat'ed again at load (`named`: one that appeared, went or changed makes
the cache stale), so a cached index is the one the pass would build; a cache that does not match
its own digest, or cannot be read, is passed over with a warning and built again (`load` never
raises: every rank must reach IndexShare.agree); a cache is written whole or not at all (a
folder renamed into place), by one rank.
"""

from __future__ import annotations

import dataclasses
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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_vlm.data.hf_processor import HFProcessor
from titan_vlm.data.images import VideoRef
from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer

logger = logging.getLogger("titan_vlm")

VERSION = 1  # of the files' layout
INDEX_FOLDER = "data_index"  # in job.dump_folder (`index_folder`)
DIGEST = re.compile(r"(\d+ files, )?\d+ bytes, [0-9a-f]{16}")  # resume_config.data_digest's
ARRAYS = ("lines", "files", "starts", "ends", "sizes")
CODE = Path(__file__).resolve().parents[1]  # titan_vlm/: its code decides what a record becomes


@dataclass(frozen=True)
class IndexCache:
    """Where a dataset keeps its index between runs, and what of the run decides the index
    besides the dataset's own arguments (the trainer's `settings`: titan_vlm's code and the
    model's family and flavor; JSON-able)."""

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


@dataclass
class CachedIndex:
    """An index as the start-up pass merges it (data/jsonl.py): per kept sample its line, file,
    byte span (or row) and slots; the counters; the bad-sample reports in file order (where,
    reason, action); the video headers read."""

    records: int
    lines: Any  # Sequence[int]: an array, or a view of the mapped file
    files: Any
    starts: Any
    ends: Any
    sizes: Any
    skipped: Counter[str]
    truncated: int
    num_images: int
    num_videos: int
    reports: list[tuple[str, str, str]]
    videos: dict[Path, VideoRef]
    # the image and video files records name: path -> [size, mtime_ns] when the pass read it
    named: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def empty(cls, records: int) -> CachedIndex:
        """An index of `records` records to fill, none kept yet."""
        lines, files, starts, ends, sizes = (array("q") for _ in ARRAYS)
        return cls(records, lines, files, starts, ends, sizes, Counter(), 0, 0, 0, [], {})


def identity(path: str) -> list[int]:
    """A file's size and modification time; [-1, -1] where it is not there (or not a file)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # ValueError: a name no file can have (a NUL, a surrogate)
        return [-1, -1]
    return [st.st_size, st.st_mtime_ns] if stat.S_ISREG(st.st_mode) else [-1, -1]


def inputs_digest(tokenizer: ByteTokenizer | HFTokenizer, processor: HFProcessor | None) -> str:
    """What the tokenizer and the folder's processor are, by what they do (not where they were
    read from: the same files in a checkpoint's copies are the same): the tokenizer's whole
    definition and special ids, the chat template, the image token and the image half."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    if isinstance(tokenizer, HFTokenizer):
        h.update(tokenizer.tok.to_str().encode())
        special = sorted(tokenizer.special_tokens.items())
        ids = (tokenizer.BOS, tokenizer.EOS, tokenizer.PAD, tokenizer.IMAGE, tokenizer.adds_bos)
        h.update(repr((ids, special)).encode())
    if processor is not None:
        p = processor
        what = (p.image_token, p.image_token_id, p.chat_template, p.template_is_tokenizers)
        h.update(repr(what).encode())
        h.update(_what(p.vision).encode())
    return h.hexdigest()


# fields that say where settings were read from, not what they are: a checkpoint's copies of a
# folder are the same settings from another place
_WHERE_FROM = frozenset({"folder", "image_file", "video_file", "template_file"})


def _what(value: object) -> str:
    """`value`'s repr with the fields of its dataclasses (at any depth) that name where it was
    read from left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f for f in dataclasses.fields(value) if f.name not in _WHERE_FROM]
        inner = ", ".join(f"{f.name}={_what(getattr(value, f.name))}" for f in fields)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_what(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_what(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def _video_json(ref: VideoRef) -> dict[str, Any]:
    return {
        "path": str(ref.path),
        "frames": [str(f) for f in ref.frames],
        "frame_size": list(ref.frame_size) if ref.frame_size is not None else None,
        "indices": list(ref.indices),
        "fps": ref.fps,
        "rate": ref.rate,
    }


def _video_ref(d: dict[str, Any]) -> VideoRef:
    size = d["frame_size"]
    return VideoRef(
        Path(d["path"]),
        frames=tuple(Path(f) for f in d["frames"]),
        frame_size=(size[0], size[1]) if size is not None else None,
        indices=tuple(d["indices"]),
        fps=d["fps"],
        rate=d["rate"],
    )


def save(folder: Path, key: str, index: CachedIndex) -> None:
    """Write `index` as key's cache in `folder` (in place of one there). A failure to write (a
    full disk, a read-only folder) is a warning: the run goes on without the cache."""
    final = folder / key
    tmp: Path | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()  # the umask's mode (mkdtemp's is the owner's alone)
        digest = hashlib.sha256()
        with open(tmp / "arrays.bin", "wb") as f:
            for name in ARRAYS:
                raw = array("q", getattr(index, name)).tobytes()
                digest.update(raw)
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        meta = {
            "version": VERSION,
            "records": index.records,
            "samples": len(index.lines),
            "arrays_sha256": digest.hexdigest(),
            "skipped": dict(index.skipped),
            "truncated": index.truncated,
            "num_images": index.num_images,
            "num_videos": index.num_videos,
            "reports": [list(r) for r in index.reports],
            "videos": [_video_json(v) for v in index.videos.values()],
            "named": [[path, *seen] for path, seen in sorted(index.named.items())],
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
            # another run wrote the same key meanwhile: the same index, theirs stays
        else:
            tmp = None
    except Exception as e:  # noqa: BLE001 - the cache is an optimisation: never stop the run
        logger.warning("data: index cache %s not written (%s): the next run builds it", final, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load(folder: Path, key: str, part: Callable[[int], range] | None = None) -> CachedIndex | None:
    """Key's cached index in `folder`, its arrays memory-mapped; None where there is none, or
    (with a warning) where it cannot be read, does not match its digest, or an image or video
    file its records name changed since it was built (`part(n)`: the run of the n named files
    this rank checks, the ranks' answers joined by IndexShare.agree; None: all). It never
    raises: every rank must reach IndexShare.agree."""
    where = folder / key
    try:
        if not (where / "meta.json").is_file():
            return None
        meta = json.loads((where / "meta.json").read_text())
        n = meta["samples"]
        with open(where / "arrays.bin", "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if n else b""
        if meta["version"] != VERSION or len(mapped) != len(ARRAYS) * n * 8:
            raise ValueError(f"{len(mapped)} bytes of arrays for {n} samples")
        if hashlib.sha256(mapped).hexdigest() != meta["arrays_sha256"]:
            raise ValueError("arrays.bin does not match its SHA-256")
        named = meta["named"]
        mine = part(len(named)) if part is not None else range(len(named))
        changed = [path for path, *seen in named[mine.start : mine.stop] if identity(path) != seen]
        if changed:
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            logger.warning(
                "data: index cache %s: an image or video file its records name changed since it "
                "was built (%s%s): building the index again",
                where,
                changed[0],
                more,
            )
            return None
        view = memoryview(mapped).cast("q") if n else memoryview(array("q"))
        lines, files, starts, ends, sizes = (view[k * n : (k + 1) * n] for k in range(5))
        videos = [_video_ref(v) for v in meta["videos"]]
        return CachedIndex(
            meta["records"],
            lines,
            files,
            starts,
            ends,
            sizes,
            skipped=Counter(meta["skipped"]),
            truncated=meta["truncated"],
            num_images=meta["num_images"],
            num_videos=meta["num_videos"],
            reports=[(w, r, a) for w, r, a in meta["reports"]],
            videos={v.path: v for v in videos},
        )
    except Exception as e:  # noqa: BLE001 - unreadable in any way: built again, on every rank
        logger.warning("data: index cache %s unusable (%s): building the index again", where, e)
        return None
