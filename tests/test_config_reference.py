"""The configuration reference is generated from the config's dataclasses: every key has a
docstring, `--help` lists every key with its type (a Literal's names), default and docstring,
and docs/configuration.md is the generated page, up to date."""

import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

from titan_vlm import config
from titan_vlm.config_schema import field_docs, key_types, reference, section_doc


@dataclass
class Example:
    """A section."""

    mode: Literal["a", "b"] = "a"
    """How it goes: "a" or
    "b"."""
    count: int = 3  # a comment is not a docstring
    undocumented: bool = False


def test_a_key_docstring_is_the_string_after_the_field():
    assert field_docs(Example) == {"mode": 'How it goes: "a" or "b".'}
    assert section_doc(Example) == "A section."
    (section, doc, keys), *_ = reference(_Root)
    assert (section, doc) == ("example", "A section.")
    assert [(k.dotted, k.typ, k.default) for k in keys] == [
        ("example.mode", "a | b", '"a"'),
        ("example.count", "int", "3"),
        ("example.undocumented", "bool", "false"),
    ]


@dataclass
class _Root:
    example: Example


def test_every_section_and_key_has_a_docstring():
    for section, section_type in config.sections().items():
        assert section_doc(section_type), f"[{section}] has no docstring"
        missing = set(key_types(section_type)) - set(field_docs(section_type))
        assert not missing, f"[{section}] keys without a docstring: {sorted(missing)}"


def test_help_lists_every_key_with_its_type_default_and_docstring():
    text = config.config_help()
    for section, _, keys in reference(config.JobConfig):
        assert f"\n[{section}]" in text
        for key in keys:
            assert f"  --{key.dotted}  ({key.typ}; default {key.default})\n" in text
    assert '--parallelism.cp_comm_type  (p2p | allgather | a2a; default "p2p")' in text


def test_python_m_config_and_run_train_print_the_same_help():
    for command in (
        [sys.executable, "-m", "titan_vlm.config", "--help"],
        [sys.executable, "-m", "titan_vlm.launch", "--help"],
    ):
        out = subprocess.run(command, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout == config.config_help(), out.stderr


def test_the_configuration_reference_is_up_to_date():
    assert config.REFERENCE.read_text() == config.reference_markdown(), (
        "docs/configuration.md is stale: run python -m titan_vlm.config --markdown"
    )


def test_python_m_config_markdown_writes_the_reference(tmp_path):
    out = tmp_path / "configuration.md"
    run = [sys.executable, "-m", "titan_vlm.config", "--markdown", str(out)]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 0 and out.read_text() == config.reference_markdown(), done.stderr
