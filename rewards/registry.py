"""Finding rewards, one mechanism for all: a name in the `kit.rewards` entry-point group (the built-ins
register there through this package's own pyproject, third-party packages through theirs), `module:function`,
or `path/to/file.py:function` (relative to the recipe file).

A reward is a plain callable `fn(prompts, completions, **columns) -> list[float | None]` with a stable
`__name__`. A factory (marked with `@reward_factory`) is called with the recipe's `args` and returns one.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from kitcli.errors import KitError, closest

ENTRY_POINT_GROUP = "kit.rewards"
SPEC_KEYS = {"name", "args", "weight", "on_error"}
ON_ERROR = ("raise", "skip")

RewardFn = Callable[..., list]


def reward_factory(fn: Callable) -> Callable:
    """Mark `fn` as a factory: the recipe's `args` are passed to it and it returns the reward callable."""
    fn.is_reward_factory = True
    return fn


@dataclass
class LoadedReward:
    fn: RewardFn
    name: str
    weight: float = 1.0
    on_error: str = "raise"
    source: str = ""
    args: dict[str, Any] = field(default_factory=dict)


def entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_rewards() -> dict[str, str]:
    """name -> where it comes from (the entry point's target and distribution)."""
    out = {}
    for name, ep in sorted(entry_points().items()):
        dist = getattr(ep, "dist", None)
        out[name] = f"{ep.value} ({dist.name if dist else 'unknown package'})"
    return out


def unknown_reward(name: str, where: str) -> KitError:
    names = list(entry_points())
    near = closest(name, names, n=3)
    ordered = near + [n for n in sorted(names) if n not in near]
    return KitError(f"{where}: unknown reward '{name}'; known rewards: {', '.join(ordered)} "
                    f"(or give module:function or path/to/file.py:function)")


def find_reward(name: str, base_dir: Path, where: str) -> tuple[Any, str]:
    """The object `name` refers to and a description of where it was found."""
    if ":" in name:
        target, _, attribute = name.rpartition(":")
        if target.endswith(".py"):
            path = Path(target).expanduser()
            if not path.is_absolute():
                path = base_dir / path
            if not path.is_file():
                raise KitError(f"{where}: reward file '{target}' does not exist (looked in {base_dir})")
            module = load_file_module(path, where)
            source = str(path)
        else:
            try:
                module = importlib.import_module(target)
            except ImportError as error:
                raise KitError(f"{where}: cannot import reward module '{target}' ({error})") from None
            source = target
        if not hasattr(module, attribute):
            available = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
            raise KitError(f"{where}: '{source}' has no function '{attribute}' "
                           f"(callables there: {', '.join(sorted(available)) or 'none'})")
        return getattr(module, attribute), f"{source}:{attribute}"
    eps = entry_points()
    if name not in eps:
        raise unknown_reward(name, where)
    try:
        return eps[name].load(), f"entry point {eps[name].value}"
    except Exception as error:
        raise KitError(f"{where}: reward '{name}' ({eps[name].value}) failed to load: {error}") from None


def load_file_module(path: Path, where: str):
    module_name = f"kit_reward_file_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise KitError(f"{where}: reward file '{path}' failed to import: {type(error).__name__}: {error}") from None
    sys.modules[module_name] = module
    return module


def normalize_spec(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict) or "name" not in raw:
        raise KitError(f"{where}: each reward is a name or a mapping with 'name' (and optional args, weight, on_error)")
    unknown = set(raw) - SPEC_KEYS
    if unknown:
        key = sorted(unknown)[0]
        hint = closest(key, SPEC_KEYS)
        raise KitError(f"{where}: reward '{raw['name']}': unknown key '{key}'"
                       f"{f'; did you mean {hint[0]!r}?' if hint else ''} (allowed: {', '.join(sorted(SPEC_KEYS))})")
    spec = {"name": str(raw["name"]), "args": raw.get("args") or {}, "weight": raw.get("weight", 1.0),
            "on_error": raw.get("on_error", "raise")}
    if not isinstance(spec["args"], dict):
        raise KitError(f"{where}: reward '{spec['name']}': args must be a mapping of keyword arguments")
    if isinstance(spec["weight"], bool) or not isinstance(spec["weight"], (int, float)):
        raise KitError(f"{where}: reward '{spec['name']}': weight must be a number, got {spec['weight']!r}")
    if spec["on_error"] not in ON_ERROR:
        raise KitError(f"{where}: reward '{spec['name']}': on_error must be one of {', '.join(ON_ERROR)}")
    return spec


def load_reward(raw: Any, base_dir: Path, where: str = "rewards") -> LoadedReward:
    spec = normalize_spec(raw, where)
    target, source = find_reward(spec["name"], base_dir, where)
    if getattr(target, "is_reward_factory", False):
        try:
            fn = target(**spec["args"])
        except TypeError as error:
            raise KitError(f"{where}: reward '{spec['name']}' does not take these args: {error}") from None
    elif spec["args"]:
        raise KitError(f"{where}: reward '{spec['name']}' takes no args (it is not a @reward_factory)")
    else:
        fn = target
    if not callable(fn):
        raise KitError(f"{where}: reward '{spec['name']}' ({source}) is not callable")
    name = getattr(fn, "__name__", spec["name"])
    return LoadedReward(fn=fn, name=name, weight=float(spec["weight"]), on_error=spec["on_error"], source=source,
                        args=spec["args"])


def load_rewards(raws: list[Any], base_dir: Path, where: str = "rewards") -> list[LoadedReward]:
    if not isinstance(raws, list):
        raise KitError(f"{where}: 'rewards' must be a list of reward names or mappings")
    return [load_reward(raw, base_dir, f"{where}[{i}]") for i, raw in enumerate(raws)]
