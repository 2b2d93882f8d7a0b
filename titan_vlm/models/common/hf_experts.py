"""A folder's mixture-of-experts tensors, whichever layout transformers wrote them in, seen as
three stacked tensors per sparse layer (`ExpertView`): what the adapters map our Experts' w1, w3
and w2 (models/common/moe.py) to, under these names:

    <layer>mlp.experts.gate_proj [E, ffn, dim]   <layer>mlp.experts.up_proj [E, ffn, dim]
    <layer>mlp.experts.down_proj [E, dim, ffn]

Layouts read (each sparse layer is one of them, told apart by names and shapes):

    per expert  Qwen3-MoE (and a LLaVA folder whose text model is one), as save_pretrained
                writes it: <layer>mlp.experts.<e>.{gate,up,down}_proj.weight, e = 0 .. E-1
    fused       Qwen3-VL-MoE as transformers 5 saves it: <layer>mlp.experts.gate_up_proj
                [E, 2 ffn, dim] (the gate's rows first) and down_proj [E, dim, ffn]
    transposed  the same names in the hub's Qwen/Qwen3-VL-*-A*B folders: gate_up_proj
                [E, dim, 2 ffn] and down_proj [E, ffn, dim] (transformers transposes them on
                load); the pair of shapes tells the two apart whatever dim and ffn are

Reads are boxes of the stacked tensors, mapped to boxes of the files (a rank reads its own
experts' rows and nothing else). `file_tensors` is the way back, for --export-hf: each layer in
the layout its source files had. Every other tensor passes through unchanged.

Where a folder's dim is 2 x ffn (gate_up_proj square in its last two dims) or dim = ffn,
transformers' per-tensor Transpose(check_dims=True) cannot tell the hub's layout from its own and
skips the transpose; the pair of shapes read here can, so such a hub folder loads right here and
not in transformers (no released model has those shapes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch

from titan_vlm.errors import ConfigError

PER_EXPERT = re.compile(r"^(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
FUSED = re.compile(r"^(.*mlp\.experts\.)(gate_up_proj|down_proj)$")


class Tensors(Protocol):
    """What a source of tensors offers (hf_folder.SafetensorsFiles, RecordedTensors)."""

    def keys(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Stacked:
    """How one stacked tensor is stored: `files` (E per-expert tensors, or one fused), and for a
    fused one the rows of its dim 1 it takes (`rows`) and whether the file is transposed."""

    files: tuple[str, ...]
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    transposed: bool = False


class ExpertView:
    """`files` with each sparse layer's expert tensors seen stacked (module docstring): keys,
    shape, dtype, read (a box) as the files offer them; other tensors as they are."""

    def __init__(self, files: Tensors, where: str):
        self.files = files
        self.where = where
        self.stacked: dict[str, Stacked] = {}
        per_expert: dict[str, dict[int, str]] = {}
        fused: dict[str, dict[str, str]] = {}
        for key in sorted(files.keys()):
            if m := PER_EXPERT.match(key):
                per_expert.setdefault(f"{m[1]}{m[3]}_proj", {})[int(m[2])] = key
            elif m := FUSED.match(key):
                fused.setdefault(m[1], {})[m[2]] = key
        for name, experts in sorted(per_expert.items()):
            if sorted(experts) != list(range(len(experts))):
                missing = min(set(range(max(experts) + 1)) - set(experts))
                raise ConfigError(
                    f"{where}: {name.replace('experts.', f'experts.{missing}.')}.weight is missing "
                    f"(the files hold experts {sorted(experts)[:4]}... of that layer)"
                )
            keys = tuple(experts[e] for e in range(len(experts)))
            shapes = {files.shape(k) for k in keys}
            if len(shapes) != 1:
                raise ConfigError(
                    f"{where}: the experts of {name} differ in shape {sorted(shapes)}"
                )
            self.stacked[name] = Stacked(keys, (len(keys), *shapes.pop()))
        for prefix, pair in fused.items():
            self._add_fused(prefix, pair)
        hidden = {f for s in self.stacked.values() for f in s.files}
        self._keys = frozenset((files.keys() - hidden) | set(self.stacked))

    def _add_fused(self, prefix: str, pair: dict[str, str]) -> None:
        if set(pair) != {"gate_up_proj", "down_proj"}:
            raise ConfigError(f"{self.where}: {prefix}gate_up_proj and down_proj come together")
        gate_up, down = pair["gate_up_proj"], pair["down_proj"]
        gu, dn = self.files.shape(gate_up), self.files.shape(down)
        if len(gu) != 3 or len(dn) != 3 or gu[0] != dn[0]:
            raise ConfigError(
                f"{self.where}: {gate_up} {list(gu)} and {down} {list(dn)} are not [experts, ...]"
            )
        if gu[1] == 2 * dn[2] and gu[2] == dn[1]:  # transformers 5: [E, 2f, d], [E, d, f]
            e, dim, ffn, transposed = gu[0], gu[2], dn[2], False
        elif gu[2] == 2 * dn[1] and gu[1] == dn[2]:  # the hub's: [E, d, 2f], [E, f, d]
            e, dim, ffn, transposed = gu[0], gu[1], dn[1], True
        else:
            raise ConfigError(
                f"{self.where}: {gate_up} {list(gu)} and {down} {list(dn)} are neither "
                "[E, 2 ffn, dim] + [E, dim, ffn] nor the transposed pair"
            )
        self.stacked[f"{prefix}gate_proj"] = Stacked(
            (gate_up,), (e, ffn, dim), (0, ffn), transposed
        )
        self.stacked[f"{prefix}up_proj"] = Stacked(
            (gate_up,), (e, ffn, dim), (ffn, 2 * ffn), transposed
        )
        self.stacked[f"{prefix}down_proj"] = Stacked((down,), (e, dim, ffn), None, transposed)

    def keys(self) -> set[str]:
        return set(self._keys)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.stacked[name].shape if name in self.stacked else self.files.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.files.dtype(self.stacked[name].files[0] if name in self.stacked else name)

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name` (stacked or not), or its `box`: only that box's bytes are read."""
        s = self.stacked.get(name)
        if s is None:
            return self.files.read(name, box)
        box = box or tuple(slice(0, n) for n in s.shape)
        read = self.files.read
        if len(s.files) > 1:  # per expert: one file tensor per index of dim 0
            experts = range(*box[0].indices(s.shape[0]))
            return torch.stack([read(s.files[e], box[1:]) for e in experts])
        d1 = box[1]
        if s.rows is not None:  # gate or up: its rows of the fused dim
            d1 = slice(d1.start + s.rows[0], d1.stop + s.rows[0])
        if s.transposed:
            return read(s.files[0], (box[0], box[2], d1)).transpose(1, 2)
        return read(s.files[0], (box[0], d1, box[2]))

    def file_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` under the stacked names -> the files' names and layout: per expert, fused
        or transposed as the files had them (an export reads wherever its source was read:
        transformers 5 transposes the hub's layout on load, older readers take it as it is);
        any other tensor as it is."""
        out = {k: v for k, v in tensors.items() if k not in self.stacked}
        for name, s in self.stacked.items():
            if name not in tensors:
                continue
            t = tensors[name]
            if len(s.files) > 1:
                out.update({f: t[e].contiguous() for e, f in enumerate(s.files)})
            elif s.rows is None:
                out[s.files[0]] = (t.transpose(1, 2) if s.transposed else t).contiguous()
            elif s.rows[0] == 0:  # the gate; the up half follows it
                up = tensors[name.removesuffix("gate_proj") + "up_proj"]
                fused = torch.cat([t, up], dim=1)
                out[s.files[0]] = (fused.transpose(1, 2) if s.transposed else fused).contiguous()
        return out
