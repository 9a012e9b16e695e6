"""Callables found by name in a module or a Python file (`module:function`, `path/to/file.py:function`), as the
reward registry and the tool registry find them, with a one-line fault naming the closest public callable; and the
files beside a recipe that define a bare name (an ambiguity the registry refuses)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from kitcli.errors import KitError, closest


def same_name_beside(name: str, base_dir: Path) -> list[Path]:
    """The Python files in the recipe's folder that define a function `name` (read, not imported): a bare reward name
    that a registered reward and such a file both answer to is ambiguous (an open-r1 user's own `format`, say)."""
    import ast

    found = []
    for path in sorted(Path(base_dir).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError, OSError):
            continue
        if any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
               for node in tree.body):
            found.append(path)
    return found


def load_named(name: str, base_dir: Path, where: str, what: str) -> tuple[Any, str]:
    """`module:attr` or `path/to/file.py:attr` (relative to `base_dir`): the object and where it was found. `what`
    (reward, tool, environment) names it in the errors; tools/registry.py finds its plugins through this too."""
    target, _, attribute = name.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise KitError(f"{where}: {what} file '{target}' does not exist (looked in {base_dir})")
        module, source = load_file_module(path, where, what), str(path)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise KitError(f"{where}: cannot import {what} module '{target}' ({error})") from None
        except Exception as error:  # the module's own error at import: one line naming it, not a traceback
            raise KitError(f"{where}: {what} module '{target}' failed to import: {type(error).__name__}: "
                           f"{error}") from None
        source = target
    if not hasattr(module, attribute):
        available = public_callables(module)
        near = closest(attribute, available)
        noun = "function " if what == "reward" else ""
        raise KitError(f"{where}: '{source}' has no {noun}'{attribute}'"
                       f"{f'; did you mean {near[0]!r}?' if near else ''} (callables there: "
                       f"{', '.join(available) or 'none'})")
    return getattr(module, attribute), f"{source}:{attribute}"


def public_callables(module) -> list[str]:
    """The module's public callables: its `__all__` (else every name), submodules left out. A lazily loaded module
    (TRL's `trl.rewards`) lists them all, not only those imported so far."""
    names = getattr(module, "__all__", None) or dir(module)
    found = []
    for name in names:
        if name.startswith("_"):
            continue
        try:
            value = getattr(module, name)
        except Exception:  # a lazy name whose import fails is not offered
            continue
        if callable(value) and not inspect.ismodule(value):
            found.append(name)
    return sorted(found)


def load_file_module(path: Path, where: str, what: str = "reward"):
    """A Python file imported as a module of its own, once per process and kind (a file may hold rewards and tools)."""
    module_name = f"kit_{what}_file_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it, as an import would (dataclasses look it up)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise KitError(f"{where}: {what} file '{path}' failed to import: {type(error).__name__}: {error}") from None
    return module
