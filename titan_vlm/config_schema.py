"""The schema of a configuration made of dataclasses, and the reference generated from it.

A configuration is a root dataclass whose fields are sections, each a dataclass of keys:

    JobConfig                       root: one field per [section]
      .parallelism: Parallelism     section: its docstring says what the section is for
        .cp_comm_type: CPCommType = "p2p"
        \"\"\"Exact attention across the CP group: ...\"\"\"   <- the key's docstring: the string
                                                         literal on the line after the field

Read from the classes themselves: each key's type (`key_types`; a `Literal` type's names are
`choices`), its default, and its docstring (`field_docs`, from the source with `ast`: Python
keeps no attribute docstrings at run time). From them: `help_text` (what `--help` prints) and
`markdown` (docs/configuration.md). This module knows nothing of titan_vlm's keys: config.py
imports it, not the other way round.
"""

import ast
import dataclasses
import inspect
import textwrap
from typing import Any, Literal, get_args, get_origin, get_type_hints


def key_types(section: type) -> dict[str, Any]:
    """{key: its type} of a dataclass, in field order; a `Literal[...]` type stays one."""
    hints = get_type_hints(section)
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def choices(typ: object) -> tuple[str, ...] | None:
    """The names a `Literal[...]` type admits, in order; None for any other type."""
    return get_args(typ) if get_origin(typ) is Literal else None


def type_name(typ: object) -> str:
    """ "int", "str", ... or, for a Literal, its names joined by " | "."""
    names = choices(typ)
    if names is not None:
        return " | ".join(names)
    return typ.__name__ if isinstance(typ, type) else str(typ)


def field_docs(section: type) -> dict[str, str]:
    """{key: its docstring, whitespace collapsed} of a dataclass: the string literal statement
    right after each annotated field in the class's source. Keys without one are absent."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(section)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def section_doc(section: type) -> str:
    """A section's class docstring, whitespace collapsed ("" when it has none of its own)."""
    doc = section.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{section.__name__}(") else " ".join(doc.split())


def toml_value(value: object) -> str:
    """A default as a TOML file writes it: strings quoted, booleans lower case."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of the reference: "section.name", its type, default (TOML spelling) and
    docstring."""

    dotted: str
    typ: str
    default: str
    doc: str


def reference(root: type) -> list[tuple[str, str, list[Key]]]:
    """(section, its docstring, its keys) for every section of a root dataclass, in order."""
    out = []
    for section, section_type in key_types(root).items():
        docs = field_docs(section_type)
        defaults = section_type()
        keys = [
            Key(
                f"{section}.{name}",
                type_name(typ),
                toml_value(getattr(defaults, name)),
                docs.get(name, ""),
            )
            for name, typ in key_types(section_type).items()
        ]
        out.append((section, section_doc(section_type), keys))
    return out


def help_text(root: type, usage: str, width: int = 100) -> str:
    """The `--help` page: `usage`, then every section and key with its type, default and
    docstring."""
    lines = [usage.rstrip(), ""]
    indent = " " * 8
    for section, doc, keys in reference(root):
        lines.append(f"[{section}]" + (f"  {doc}" if doc else ""))
        for key in keys:
            lines.append(f"  --{key.dotted}  ({key.typ}; default {key.default})")
            lines += textwrap.wrap(key.doc, width, initial_indent=indent, subsequent_indent=indent)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(root: type, title: str, intro: str) -> str:
    """The reference page: `title`, `intro` (Markdown), then a table of keys per section."""
    lines = [f"# {title}", "", intro.strip(), ""]
    for section, doc, keys in reference(root):
        lines += [f"## [{section}]", ""]
        if doc:
            lines += [doc, ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key in keys:
            typ = " \\| ".join(f"`{n}`" for n in key.typ.split(" | "))
            lines.append(f"| `{key.dotted}` | {typ} | `{_cell(key.default)}` | {_cell(key.doc)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
