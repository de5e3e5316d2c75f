"""The house rules, read from the code itself (the imports and the files), so that no table in the docs has to
say them and drift: the top level is the paper's method and the commands, everything else lives in a room (a
folder named for its job); the model is the ground floor and imports no room; the shell knows no model; a
command imports no other command; nothing imports in a circle, an import inside a function included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = {"tests", "bench", "docs", "slurm", ".venv", ".git"}  # not importable code of the house
DESIGN_CARD = {
    "parvl",
    "vit",
    "llm",
    "aggregate",
    "router",
    "train",
    "generate",
    "evaluate",
    "profiling",
}


def modules() -> dict[str, Path]:
    """Every module of the house by its import name: `parvl`, `inference.engine`, ..."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in OUTSIDE or any(p.startswith(".") for p in parts):
            continue
        name = ".".join(parts)[:-3].removesuffix(".__init__")
        found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The house's modules `path` imports, at the top or inside a function alike."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: a relative import (the house imports by full name)"
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names & known


MODULES = modules()
GRAPH = {name: imports(path, set(MODULES)) - {name} for name, path in MODULES.items()}


def room(name: str) -> str | None:
    return name.split(".")[0] if "." in name or (ROOT / name).is_dir() else None


def is_command(name: str) -> bool:
    """A top-level module run as `python NAME.py`."""
    return room(name) is None and 'if __name__ == "__main__"' in MODULES[name].read_text()


TOP = sorted(n for n in MODULES if room(n) is None)
COMMANDS = [n for n in TOP if is_command(n)]
METHOD = [n for n in TOP if not is_command(n)]


def test_the_top_level_is_the_method_and_the_commands():
    assert len(TOP) <= 16, f"{len(TOP)} Python files at the top level: {TOP}"
    assert DESIGN_CARD <= set(TOP), (
        f"the design card's files missing at the top: {DESIGN_CARD - set(TOP)}"
    )
    assert set(COMMANDS) == {"generate", "train", "evaluate", "router", "profiling", "study"}, (
        COMMANDS
    )
    for folder in {room(n) for n in MODULES} - {None}:
        init = ROOT / folder / "__init__.py"
        assert init.is_file() and init.read_text() == "", f"{folder}/ needs an empty __init__.py"
        assert not (ROOT / f"{folder}.py").exists(), (
            f"{folder}/ takes the name of a top-level module"
        )


def test_the_model_is_the_ground_floor():
    """The method's files import only each other: no room (not even loading or the engine) and no command."""
    for name in METHOD:
        above = sorted(d for d in GRAPH[name] if d not in METHOD)
        assert not above, (
            f"{name}.py imports {above}: the method's files stand on nothing but each other"
        )


def test_the_shell_knows_no_model():
    for name in (n for n in MODULES if room(n) == "shell"):
        outside = sorted(d for d in GRAPH[name] if room(d) != "shell")
        assert not outside, (
            f"{name} imports {outside}: the shell is what every command shares, model-free"
        )


def test_no_command_is_imported():
    for name, deps in GRAPH.items():
        commands = sorted(d for d in deps if d in COMMANDS)
        assert not commands, f"{name} imports the command(s) {commands}: commands stand on top"


def test_no_import_circle():
    """Depth-first over the import graph (imports inside functions count): a reader can read the house
    bottom up."""
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            assert state.get(dep) != 1, "import circle: " + " -> ".join(
                path[path.index(dep) :] + [dep]
            )
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_the_rules_can_fail(tmp_path, monkeypatch):
    """The checks above see what they claim to: a circle and an upward import built here are found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import b\n")
    b.write_text("def f():\n    from a import x\n")
    assert imports(a, {"a", "b"}) == {"b"} and imports(b, {"a", "b"}) == {"a"}
    (tmp_path / "c.py").write_text("from inference.engine import Engine\n")
    assert imports(tmp_path / "c.py", set(MODULES)) == {"inference.engine"}
