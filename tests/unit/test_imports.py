"""The package's modules import each other without cycles, lazily or not, and even for types
alone: every `import` / `from ... import` of a titan_vlm module anywhere in a file counts (inside
functions and under `if TYPE_CHECKING:` too: a type-only cycle is still two modules that cannot
be understood one without the other). And the layers stay apart: the core (layout, attention,
parallel, data, the trainer) never names a model family's folder; only the registry and the
families' own folders do."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "titan_vlm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("titan_vlm"):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert "titan_vlm.config" in graph and graph["titan_vlm.train"]  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


FAMILIES = PACKAGE / "models"


def _family_folders() -> set[str]:
    return {
        f"titan_vlm.models.{p.name}"
        for p in FAMILIES.iterdir()
        if p.is_dir() and p.name not in ("common", "__pycache__")
    }


def test_only_the_registry_and_the_families_name_a_family():
    graph = import_graph()
    families = _family_folders()
    assert "titan_vlm.models.llava" in families
    allowed = {"titan_vlm.models.registry"}
    for module, targets in graph.items():
        own = next((f for f in families if module == f or module.startswith(f + ".")), None)
        for target in targets:
            family = next((f for f in families if target == f or target.startswith(f + ".")), None)
            if family is None or family == own or module in allowed:
                continue
            raise AssertionError(f"{module} imports {target}: only the registry names a family")
