"""The structure the codebase keeps: files a reader can take in (under 450 lines), `rewards/` a library of its own
(of the kit it uses only the bottom layer: the error class and the run directory's layout; nothing of the runner,
the stages or the CLI), and no circle among the modules' top-level imports (imports
inside functions, which keep `kit --help` fast, are lazy by design and not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kitcli", "rewards")
MAX_LINES = 450
REWARDS_MAY_USE = {"kitcli.errors", "kitcli.rundir"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports at module level (not inside functions or TYPE_CHECKING blocks)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            imported |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    resolved = set()
    for target in imported:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def test_every_module_is_under_450_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) >= MAX_LINES}
    assert not long, f"split these: {long}"


def test_rewards_uses_only_the_bottom_layer_of_the_kit():
    known = set(modules())
    for name, path in modules().items():
        if name.startswith("rewards"):
            used = {n.module for n in ast.walk(ast.parse(path.read_text()))  # lazy imports too
                    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("kitcli")}
            used |= {m for m in top_level_imports(path, name, known) if m.startswith("kitcli")}
            assert used <= REWARDS_MAY_USE, (name, used - REWARDS_MAY_USE)


def test_no_circle_among_top_level_imports():
    known = set(modules())
    graph = {name: top_level_imports(path, name, known) for name, path in modules().items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circle = trail[trail.index(target):] + [target] if target in trail else [name, target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_fast_tests_cannot_build_a_trainer(request, fast_tests_train_nothing):
    """`make test-fast` trains nothing: under -m "not slow" building a trainer fails the test (conftest)."""
    from kitcli.training import trainers

    fast = (request.config.option.markexpr or "").replace(" ", "") == "notslow"
    assert fast_tests_train_nothing == fast
    if fast:
        with pytest.raises(pytest.fail.Exception, match="mark it slow"):
            trainers.trainer_class("sft")
