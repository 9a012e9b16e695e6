"""The structure the codebase keeps: files a reader can take in (under 400 lines); a folder per layer whose
`__init__.py` says, in a line `May import: a/, b/, the ground.`, which folders its modules may import (read here, so
the rule is written once, where a reader of the folder sees it); the ground (the modules beside kitcli/__init__.py)
imports no folder; `rewards/` uses only kitcli/errors.py and kitcli/rundir.py of the kit; and no import circle.
Between layers every import counts, those inside functions (which keep `kit --help` fast) too: a lazy import is
still an arrow. So does a circle: imports inside functions and `importlib.import_module` with a name the code writes
(a string, or an f-string's fixed start: every module under it, as the stage-type registry imports kitcli/stages/)
count; an import under `if TYPE_CHECKING:` runs only for a type checker and does not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kitcli", "rewards", "tools")
MAX_LINES = 400
REWARDS_MAY_USE = {"kitcli.errors", "kitcli.rundir"}
TOOLS_MAY_USE = {"kitcli.errors"}
LIBRARIES = ("rewards", "tools")  # standalone libraries beside kitcli/
GROUND = "the ground"
TOP = "entry points"
# `python -m` entry points beside the ground: each hands over to a folder (kitcli/__init__.py names them)
ENTRY_POINTS = {"kitcli.__main__", "kitcli.tiny", "kitcli.synthetic"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def runtime_nodes(tree: ast.AST):
    """Every node of a file but those under `if TYPE_CHECKING:` (imported for a type checker, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in (child, *runtime_nodes(child)))
            continue
        yield node
        yield from runtime_nodes(node)


def project_imports(path: Path, name: str, known: set[str], lazy: bool = False, runtime: bool = False) -> set[str]:
    """The project modules `path` imports at module level (not inside functions or TYPE_CHECKING blocks), or with
    `lazy` anywhere in the file (with `runtime`, not under TYPE_CHECKING: the imports that run)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    imported = set()
    nodes = (runtime_nodes(tree) if runtime else ast.walk(tree)) if lazy else tree.body
    for node in nodes:
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


def import_graph() -> dict[str, set[str]]:
    """Every arrow between the project's modules: module -> the modules it imports (lazily too)."""
    found = modules()
    return {name: project_imports(path, name, set(found), lazy=True) for name, path in found.items()}


def dynamic_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports with `importlib.import_module(NAME)` (or `import_module` imported from
    importlib): a string names one module, an f-string's fixed start every module under it. A name computed at run
    time cannot be followed here."""
    tree = ast.parse(path.read_text())
    aliases = {"importlib.import_module"} | {f"{a.asname or a.name}" for n in ast.walk(tree)
                                             if isinstance(n, ast.ImportFrom) and n.module == "importlib"
                                             for a in n.names if a.name == "import_module"}
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) in aliases and node.args):
            continue
        argument = node.args[0]
        if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
            found |= {argument.value} & known
        elif isinstance(argument, ast.JoinedStr) and argument.values and isinstance(argument.values[0], ast.Constant):
            start = argument.values[0].value
            found |= {module for module in known if module.startswith(start) and module != start.rstrip(".")}
    return found


def running_graph() -> dict[str, set[str]]:
    """Every import that runs: module level, inside functions, and importlib's by a name the code writes."""
    found = modules()
    known = set(found)
    return {name: (project_imports(path, name, known, lazy=True, runtime=True) | dynamic_imports(path, known)) - {name}
            for name, path in found.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                return trail[trail.index(target):] + [target]
            if target not in state:
                circle = visit(target, trail + [target])
                if circle:
                    return circle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            circle = visit(name, [name])
            if circle:
                return circle
    return None


def layer_of(module: str) -> str:
    """The folder a module lives in (`rewards`, `run`, ...), the ground, or the entry points."""
    parts = module.split(".")
    if parts[0] in LIBRARIES:
        return parts[0]
    if module in ENTRY_POINTS:
        return TOP
    if len(parts) > 2 or len(parts) == 2 and (ROOT / "kitcli" / parts[1]).is_dir():
        return parts[1]
    return GROUND


def may_import() -> dict[str, set[str]]:
    """Each layer folder -> the folders its `__init__.py` says it may import (the ground always may)."""
    rules = {}
    for init in sorted([*(ROOT / "kitcli").glob("*/__init__.py"), *(ROOT / lib / "__init__.py" for lib in LIBRARIES)]):
        said = re.search(r"^.*May import: (.*)$", ast.get_docstring(ast.parse(init.read_text())) or "", re.M)
        assert said, f"{init.relative_to(ROOT)}: say in its docstring what it may import ('May import: a/, b/.')"
        rules[init.parent.name] = set(re.findall(r"\b([a-z_]+)/(?![\w.])", said.group(1)))
    return rules


def rule_home(layer: str) -> str:
    homes = {GROUND: "the ground, kitcli/*.py,", **{lib: f"{lib}/__init__.py" for lib in LIBRARIES}}
    return homes.get(layer, f"kitcli/{layer}/__init__.py")


def floors(rules: dict[str, set[str]]) -> dict[str, int]:
    """The floor of each layer: the ground is 0, a folder stands one above the highest it may import, the entry
    points stand on top. A circle among the rules fails."""
    found = {GROUND: 0}

    def floor(layer: str, trail: tuple[str, ...]) -> int:
        if layer not in found:
            assert layer not in trail, "the folders' rules go round: " + " -> ".join([*trail, layer])
            unknown = rules[layer] - set(rules)
            assert not unknown, f"{rule_home(layer)} names {sorted(unknown)}: no such layer folder"
            found[layer] = 1 + max((floor(below, (*trail, layer)) for below in rules[layer]), default=0)
        return found[layer]

    for layer in rules:
        floor(layer, ())
    found[TOP] = 1 + max(found.values())
    return found


def upward_arrows(graph: dict[str, set[str]], floor: dict[str, int]) -> list[str]:
    """The arrows from one layer into another that does not stand below it."""
    return [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
            if layer_of(a) != layer_of(b) and floor[layer_of(b)] >= floor[layer_of(a)]]


def test_every_module_is_under_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) >= MAX_LINES}
    assert not long, f"split these: {long}"


@pytest.mark.parametrize("library, may_use", [("rewards", REWARDS_MAY_USE), ("tools", TOOLS_MAY_USE)])
def test_libraries_use_only_the_bottom_layer_of_the_kit(library, may_use):
    known = set(modules())
    for name, path in modules().items():
        if name.split(".")[0] == library:
            used = {n.module for n in ast.walk(ast.parse(path.read_text()))  # lazy imports too
                    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("kitcli")}
            used |= {m for m in project_imports(path, name, known) if m.startswith("kitcli")}
            assert used <= may_use, (name, used - may_use)


def test_no_circle_among_top_level_imports():
    known = set(modules())
    circle = find_circle({name: project_imports(path, name, known) for name, path in modules().items()})
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_circle_with_imports_inside_functions_and_through_importlib():
    """The imports that run, wherever they are: a module that imports (or asks the stage-type registry, which imports
    kitcli/stages/ by name) a module that imports it back is a circle, however late either import happens."""
    circle = find_circle(running_graph())
    assert circle is None, "import circle (inside functions / importlib included): " + " -> ".join(circle)


def test_the_circle_check_reads_importlib_and_lazy_imports():
    """What the check above stands on: the registry's importlib arrows into kitcli/stages/, a lazy import's arrow, and
    no arrow from an import only a type checker reads."""
    graph = running_graph()
    assert {"kitcli.stages.sft", "kitcli.stages.grpo"} <= graph["kitcli.recipe.stage_types"]
    assert "kitcli.recipe.stage_types" in graph["kitcli.recipe.load"]  # validate_recipe imports it in the function
    assert "kitcli.recipe.load" not in graph["kitcli.recipe.stage_context"]  # `Recipe` under TYPE_CHECKING only


def test_every_layer_folder_says_what_it_may_import_and_commands_is_the_top():
    rules = may_import()
    assert set(rules) == {p.parent.name for p in (ROOT / "kitcli").glob("*/__init__.py")} | set(LIBRARIES)
    floor = floors(rules)
    assert not [layer for layer, below in rules.items() if "commands" in below], "nothing may import commands/"
    assert max(floor[layer] for layer in rules) == floor["commands"]
    assert rules["rewards"] == set(), "rewards/ stands alone: of the kit, only the ground"
    assert rules["tools"] == {"rewards"}, "tools/ stands beside rewards/: its sandbox and the ground only"


def test_no_arrow_runs_up_between_layers():
    """An import into a layer on the same floor or above (models/ -> run/, display/ -> stages/, the ground ->
    any folder) is refused, and named."""
    up = upward_arrows(import_graph(), floors(may_import()))
    assert not up, up


def test_each_folder_imports_only_what_its_init_says():
    rules = may_import()
    allowed = {**{layer: below | {layer, GROUND} for layer, below in rules.items()}, GROUND: {GROUND}}
    broken = [f"{a} -> {b} ({rule_home(layer_of(a))} allows {sorted(rules.get(layer_of(a), ()))}, the ground)"
              for a, targets in sorted(import_graph().items()) for b in sorted(targets)
              if layer_of(a) != TOP and layer_of(b) not in allowed[layer_of(a)]]
    assert not broken, broken


def test_the_ground_and_the_entry_points():
    """The ground (kitcli/*.py) imports no folder; each entry point hands over to one folder."""
    graph = import_graph()
    ground = {m for m in graph if layer_of(m) == GROUND}
    assert {"kitcli", "kitcli.errors", "kitcli.rundir", "kitcli.records"} <= ground
    assert {m: graph[m] for m in ground if graph[m] - ground} == {}
    assert {m: {layer_of(t) for t in graph[m]} for m in ENTRY_POINTS} == {
        "kitcli.__main__": {"commands"}, "kitcli.tiny": {"models"}, "kitcli.synthetic": {"data"}}


def test_fast_tests_cannot_build_a_trainer(request, fast_tests_train_nothing):
    """`make test-fast` trains nothing: under -m "not slow" building a trainer fails the test (conftest)."""
    from kitcli.training import trainers

    fast = (request.config.option.markexpr or "").replace(" ", "") == "notslow"
    assert fast_tests_train_nothing == fast
    if fast:
        with pytest.raises(pytest.fail.Exception, match="mark it slow"):
            trainers.trainer_class("sft")
