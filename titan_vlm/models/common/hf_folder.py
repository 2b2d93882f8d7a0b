"""A Hugging Face model folder as `save_pretrained` writes it, read without loading its tensors.

    <folder>/config.json                      the architecture (a family's hf_config.py reads it)
    <folder>/model.safetensors                the weights, or
    <folder>/model.safetensors.index.json     {"weight_map": {tensor name: shard file}} + the shards

`SafetensorsFiles` knows every tensor's name, shape and dtype from the files' headers and reads
any rectangular slice of one tensor (the safetensors slice API), so a rank reads only the part
of each tensor it owns (models/loading.py). Nothing here imports transformers.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from titan_vlm.errors import ConfigError
from titan_vlm.files import cannot_read, read_json

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def weight_files(folder: Path, key: str) -> list[Path]:
    """The safetensors files of a model folder, or a single .safetensors file given directly.
    transformers' rule (modeling_utils._get_resolved_checkpoint_files): model.safetensors when
    the folder has it, even beside an index; else the shards model.safetensors.index.json names."""
    if folder.is_file() and folder.suffix == ".safetensors":
        return [folder]
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is neither a model folder nor a .safetensors file")
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if (folder / INDEX).is_file():
        weight_map = read_json(folder / INDEX, key).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{key}: {folder / INDEX} has no 'weight_map'")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(
                f"{key}: {folder / INDEX} names missing shard(s) {', '.join(missing)}"
            )
        return files
    raise ConfigError(f"{key}: {folder} has neither {SINGLE} nor {INDEX}")


# The config keys of a model's Hugging Face sources (a folder, or a tower's .safetensors file)
HF_SOURCE_KEYS = ("model.hf_path", "model.hf_vision_path", "model.hf_text_path")


def hf_sources(cfg: JobConfig) -> list[tuple[str, Path]]:
    """(config key, path) of every Hugging Face source the config names."""
    values = {key: getattr(cfg.model, key.removeprefix("model.")) for key in HF_SOURCE_KEYS}
    return [(key, Path(value)) for key, value in values.items() if value]


# Files of a source folder that are weights or too big to digest at every start: their size
# stands for them (a checkpoint holds the trained weights; the source's are read at the start of
# training only, and by the export for the tensors the model does not use)
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".ot",
    ".npz",
)


def source_file_paths(cfg: JobConfig) -> list[tuple[str, Path]]:
    """(config key, file) of every file the model and tokenizer of `cfg` are read from besides
    the weights' bytes: each file of a model.hf_path folder (weights included: `source_files`
    takes them by size) but hidden ones (an editor's swap file, NFS's .nfs*); a tower's folder
    or file (hf_vision_path, hf_text_path): its config.json, and a folder's weight files;
    model.tokenizer_path's file."""
    found: list[tuple[str, Path]] = []
    for key, path in hf_sources(cfg):
        folder = path.parent if path.is_file() else path
        if not folder.is_dir():
            continue
        if key == "model.hf_path":
            files = [f for f in sorted(folder.iterdir()) if f.is_file()]
            found += [(key, f) for f in files if not f.name.startswith(".")]
        else:
            tower = [folder / "config.json"]
            tower += [path] if path.is_file() else [folder / SINGLE, folder / INDEX]
            found += [(key, f) for f in tower if f.is_file()]
    if cfg.model.tokenizer_path and Path(cfg.model.tokenizer_path).is_file():
        found.append(("model.tokenizer_path", Path(cfg.model.tokenizer_path)))
    return found


def source_files(cfg: JobConfig) -> dict[str, str]:
    """A fingerprint of the Hugging Face sources `cfg` builds its model and tokenizer from
    (`source_file_paths`): {"<key>: <file>": "<size> bytes, <SHA-256 prefix>"}, weight files by
    their size alone. What a checkpoint records (resume_config.run_facts) and a resume compares
    (`source_changes`); an unreadable file is one line."""
    import hashlib

    found: dict[str, str] = {}
    for key, f in source_file_paths(cfg):
        try:
            size = f.stat().st_size
            if f.suffix in WEIGHT_SUFFIXES:
                found[f"{key}: {f.name}"] = f"{size} bytes"
                continue
            h = hashlib.sha256()
            with open(f, "rb") as stream:
                while chunk := stream.read(1 << 22):
                    h.update(chunk)
        except OSError as e:
            raise cannot_read(key, f, e) from None
        found[f"{key}: {f.name}"] = f"{size} bytes, {h.hexdigest()[:16]}"
    return found


def source_changes(
    saved: dict[str, str], now: dict[str, str], since: str = "since the checkpoint was written"
) -> str | None:
    """What differs between two `source_files` fingerprints, one phrase ("the source files
    model.hf_path: config.json changed (...), model.hf_path: tokenizer.json removed <since>");
    None when they agree."""
    parts = []
    for name in sorted(saved.keys() | now.keys()):
        if name not in now:
            parts.append(f"{name} removed")
        elif name not in saved:
            parts.append(f"{name} added")
        elif saved[name] != now[name]:
            parts.append(f"{name} changed ({saved[name]} -> {now[name]})")
    if not parts:
        return None
    return "the source files " + ", ".join(parts) + f" {since}"


def config_path(path: Path, key: str = "model.hf_path") -> Path:
    """The config.json of a model folder, or of the folder holding a .safetensors file; any
    other file where the folder belongs is one line naming `key`."""
    if path.is_file() and path.suffix != ".safetensors":
        raise ConfigError(
            f"{key}: {path} is a file, not a model folder (the folder holding config.json, the "
            "weights and the tokenizer files)"
        )
    return (path.parent if path.is_file() else path) / "config.json"


# A checkpoint's copy of a source folder (checkpoint.py copy_sources) holds the folder's other
# files, the name, dtype and shape of every tensor of its weights (RECORDED) and the tensors the
# model does not use (UNUSED): what --export-hf needs besides the trained weights.
RECORDED = "source_tensors.json"
UNUSED = "unused.safetensors"


class RecordedTensors:
    """The tensors of a checkpoint's copy of a source folder, as SafetensorsFiles offers them:
    every name, dtype and shape; the bytes of the unused ones only."""

    def __init__(self, folder: Path, key: str):
        self.key = key
        self.recorded = read_json(folder / RECORDED, key)
        self.unused = (
            SafetensorsFiles([folder / UNUSED], key) if (folder / UNUSED).is_file() else None
        )

    def __enter__(self) -> RecordedTensors:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.unused = None

    def keys(self) -> set[str]:
        return set(self.recorded)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.recorded[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self.recorded[name]["dtype"]
        if code not in DTYPES:
            raise ConfigError(f"{self.key}: tensor '{name}' has dtype {code}, not a float type")
        return DTYPES[code]

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        if self.unused is None or name not in self.unused.keys():
            raise ConfigError(f"{self.key}: the checkpoint's copy holds no bytes of '{name}'")
        return self.unused.read(name, box)


def source_tensors(path: Path, key: str) -> SafetensorsFiles | RecordedTensors:
    """The tensors of a source: a checkpoint's copy of it (RecordedTensors), or the folder's (or
    the .safetensors file's) own files."""
    if path.is_dir() and (path / RECORDED).is_file():
        return RecordedTensors(path, key)
    return SafetensorsFiles(weight_files(path, key), key)


class SafetensorsFiles:
    """Every tensor of a set of safetensors files: names, shapes, dtypes and slice reads.

    Use as a context manager (the files stay open, memory-mapped, while it is entered)."""

    def __init__(self, files: list[Path], key: str):
        from safetensors import safe_open

        self.key = key
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        for path in files:
            try:
                with open(path, "rb"):  # unreadable: say so, not what safetensors makes of it
                    pass
            except OSError as e:
                raise cannot_read(key, path, e) from None
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # the library's own header errors: a truncated or foreign file
                raise ConfigError(f"{key}: {path} is not a safetensors file ({e})") from None
            self._handles[path] = handle
            for name in handle.keys():
                if name in self._where:
                    raise ConfigError(
                        f"{key}: tensor '{name}' is in both {self._where[name]} and {path}"
                    )
                self._where[name] = path

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._handles.clear()

    def keys(self) -> set[str]:
        return set(self._where)

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def dtype_code(self, name: str) -> str:
        """The safetensors dtype of tensor `name` ("F32", "BF16", "I64", ...)."""
        return str(self._handles[self._where[name]].get_slice(name).get_dtype())

    def dtype(self, name: str) -> torch.dtype:
        code = self.dtype_code(name)
        if code not in DTYPES:
            raise ConfigError(f"{self.key}: tensor '{name}' has dtype {code}, not a float type")
        return DTYPES[code]

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, or only its `box` (one slice per dim): the bytes of that box are all
        that is read from the file."""
        part = self._handles[self._where[name]].get_slice(name)
        if box is None:
            return part[:]
        if not box:  # a 0-d tensor
            return part[:]
        return part[box]
