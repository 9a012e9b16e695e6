"""Finding rewards, one mechanism for all: a name in the `kit.rewards` entry-point group (the built-ins
register there through this package's own pyproject, third-party packages through theirs), `module:function`,
or `path/to/file.py:function` (relative to the recipe file).

A reward is a plain callable `fn(prompts, completions, **columns) -> list[float | None]` with a stable
`__name__`. A factory is called with the recipe's `args` and returns one: any callable named with `args:`
(TRL's `trl.rewards:get_soft_overlong_punishment`, open-r1's `get_cosine_scaled_reward`, ...), or one whose
parameters are not a reward's (no prompts, completions, completion_ids or **kwargs) named without; kit's own
are marked `@reward_factory`, which also lets them declare a score range. A factory that declares `base_dir` or
`run_dir` parameters gets the recipe's directory and the run directory. `name_as:` renames a reward (TRL logs
each by its name, so two rewards of one name in a stage are refused).

Optional attributes a reward may carry: `score_range = (low, high)` (set by `@score_range(low, high)`, on the
function or on its factory), the interval every score falls in, which the guard enforces during training;
`required_columns`, the dataset columns it reads; `check_rows(rows)`, which raises ValueError naming the row when
the data cannot be scored (run by `check_data` before any model loads).
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from kitcli.errors import KitError, closest
from rewards.modules import load_named, same_name_beside

ENTRY_POINT_GROUP = "kit.rewards"
BUILTIN_DISTRIBUTION = "lora-kit"  # this package: its rewards are the built-ins
SPEC_KEYS = {"name", "args", "weight", "on_error", "name_as"}
ON_ERROR = ("raise", "skip")

RewardFn = Callable[..., list]
# Keyword arguments TRL's GRPOTrainer passes on top of the dataset columns; not columns a reward can require.
TRAINER_ARGUMENTS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                     "environments"}
REWARD_PARAMETERS = {"prompts", "completions", "completion_ids"}  # what marks a callable as a reward, not a factory
INJECTED = ("base_dir", "run_dir")


def reward_factory(fn: Callable) -> Callable:
    """Mark `fn` as a factory: the recipe's `args` are passed to it and it returns the reward callable."""
    fn.is_reward_factory = True
    return fn


def score_range(low: float, high: float) -> Callable[[Callable], Callable]:
    """Declare that every score of a reward (or of the rewards a factory makes) lies in [low, high]: a score
    outside it stops training with an error naming the reward, the value and the range."""
    if not (isinstance(low, (int, float)) and isinstance(high, (int, float))) or not low <= high:
        raise ValueError(f"score_range needs two numbers low <= high, got {low!r}, {high!r}")

    def declare(fn: Callable) -> Callable:
        fn.score_range = (float(low), float(high))
        return fn

    return declare


def declared_range(fn: Any, where: str, name: str) -> tuple[float, float] | None:
    """The range a reward declares (`score_range` attribute), checked: two numbers low <= high, or None."""
    declared = getattr(fn, "score_range", None)
    if declared is None:
        return None
    try:
        low, high = (float(v) for v in declared)
    except (TypeError, ValueError):
        low = high = math.nan
    if not low <= high:  # also false for NaN
        raise KitError(f"{where}: reward '{name}' declares score_range {declared!r}; it must be (low, high) with "
                       f"low <= high")
    return low, high


@dataclass
class LoadedReward:
    fn: RewardFn
    name: str
    weight: float = 1.0
    on_error: str = "raise"
    source: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    score_range: tuple[float, float] | None = None  # every score must lie in [low, high] (None: any number)


def distribution_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "unknown package"


def entry_points(group: str = ENTRY_POINT_GROUP) -> dict[str, metadata.EntryPoint]:
    """name -> entry point in `group` (`kit.rewards`; tools/registry.py reads `kit.tools` with it). The same
    target seen twice (an editable install and its source checkout's egg-info) counts once; two packages
    registering one reward name for different targets is an error when that name is used."""
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        found.setdefault(ep.name, ep)
    return found


def conflicting(name: str, group: str = ENTRY_POINT_GROUP) -> list[metadata.EntryPoint]:
    """The entry points of `group` named `name` with different targets (two packages claiming one name)."""
    targets = {}
    for ep in metadata.entry_points(group=group):
        if ep.name == name:
            targets.setdefault(ep.value, ep)
    return list(targets.values()) if len(targets) > 1 else []


def known_rewards() -> dict[str, str]:
    """name -> where it comes from (the entry point's target and distribution)."""
    return {name: f"{ep.value} ({distribution_name(ep)})" for name, ep in sorted(entry_points().items())}


def first_doc_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0].strip().rstrip(".") if doc else ""


def reward_catalog() -> list[dict[str, str]]:
    """Every registered reward: name, where it comes from, the args its factory takes ("-" for a plain function)
    and the first line of its docstring. A reward that fails to import is listed with the error."""
    rows = []
    for name, ep in sorted(entry_points().items()):
        dist = distribution_name(ep)
        row = {"name": name, "source": "built-in" if dist == BUILTIN_DISTRIBUTION else f"{dist} ({ep.value})",
               "args": "", "doc": ""}
        try:
            target = ep.load()
        except Exception as error:  # a broken third-party package must not hide the others
            row["doc"] = f"fails to load: {type(error).__name__}: {error}"
        else:
            row["args"] = (", ".join(factory_args(target)) or "-") if getattr(target, "is_reward_factory", False) \
                else "-"
            row["doc"] = first_doc_line(target)
        rows.append(row)
    return rows


def factory_args(factory: Callable, injected: tuple[str, ...] = INJECTED) -> list[str]:
    """The arguments a recipe may give a factory in `args:` (the ones the kit injects left out: for rewards
    base_dir and run_dir; tools/registry.py passes its own)."""
    try:
        return [p.name for p in inspect.signature(factory).parameters.values()
                if p.name not in injected and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return []


def by_similarity(name: str, names) -> list[str]:
    """All `names`, the closest to `name` first."""
    return sorted(names, key=lambda n: (-difflib.SequenceMatcher(None, name.lower(), n.lower()).ratio(), n))


def unknown_reward(name: str, where: str) -> KitError:
    names = by_similarity(name, entry_points())
    near = closest(name, names)
    hint = f" Did you mean '{near[0]}'?" if near else ""
    return KitError(f"{where}: unknown reward '{name}'.{hint} Known rewards: {', '.join(names) or 'none'} "
                    f"(or give module:function or path/to/file.py:function; `kit rewards list` describes them)")


def find_reward(name: str, base_dir: Path, where: str) -> tuple[Any, str]:
    """The object `name` refers to and a description of where it was found."""
    if ":" in name:
        return load_named(name, base_dir, where, "reward")
    eps = entry_points()
    if name not in eps:
        raise unknown_reward(name, where)
    mine = same_name_beside(name, base_dir)
    if mine:
        raise KitError(f"{where}: reward '{name}' is ambiguous: the registered {eps[name].value} and "
                       f"{', '.join(f'{path.name}:{name}' for path in mine)} in the recipe's folder ({base_dir}); "
                       f"name the one you mean: {mine[0].name}:{name} or {eps[name].value}")
    clash = conflicting(name)
    if clash:
        listed = "; ".join(f"{ep.value} ({distribution_name(ep)})" for ep in clash)
        raise KitError(f"{where}: reward '{name}' is registered by more than one package: {listed}; uninstall one, "
                       f"or name the function you mean as module:function")
    try:
        return eps[name].load(), f"entry point {eps[name].value}"
    except Exception as error:
        raise KitError(f"{where}: reward '{name}' ({eps[name].value}) failed to load: {error}") from None


def normalize_spec(raw: Any, where: str) -> dict[str, Any]:
    """A reward as a mapping: a name, a mapping, or a validated spec read by its attributes (the kit's RewardSpec)."""
    if isinstance(raw, str):
        raw = {"name": raw}
    elif not isinstance(raw, dict) and hasattr(raw, "name"):
        raw = {key: getattr(raw, key) for key in SPEC_KEYS if hasattr(raw, key)}
    if not isinstance(raw, dict) or "name" not in raw:
        raise KitError(f"{where}: each reward is a name or a mapping with 'name' (and optional args, weight, on_error)")
    unknown = set(raw) - SPEC_KEYS
    if unknown:
        key = sorted(unknown)[0]
        hint = closest(key, SPEC_KEYS)
        raise KitError(f"{where}: reward '{raw['name']}': unknown key '{key}'"
                       f"{f'; did you mean {hint[0]!r}?' if hint else ''} (allowed: {', '.join(sorted(SPEC_KEYS))})")
    spec = {"name": str(raw["name"]), "args": raw.get("args") or {}, "weight": raw.get("weight", 1.0),
            "on_error": raw.get("on_error", "raise"), "name_as": raw.get("name_as")}
    if spec["name_as"] is not None and (not isinstance(spec["name_as"], str) or not spec["name_as"].strip()
                                        or "/" in spec["name_as"]):
        raise KitError(f"{where}: reward '{spec['name']}': name_as must be a non-empty name without '/', got "
                       f"{spec['name_as']!r}")
    if not isinstance(spec["args"], dict):
        raise KitError(f"{where}: reward '{spec['name']}': args must be a mapping of keyword arguments")
    if isinstance(spec["weight"], bool) or not isinstance(spec["weight"], (int, float)):
        raise KitError(f"{where}: reward '{spec['name']}': weight must be a number, got {spec['weight']!r}")
    if spec["on_error"] not in ON_ERROR:
        raise KitError(f"{where}: reward '{spec['name']}': on_error must be one of {', '.join(ON_ERROR)}")
    return spec


def signature_text(fn: Callable) -> str:
    """`name(a, b=1, **kwargs)`, as a one-line error shows a callable."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return f"{name}(...)"


def is_reward_signature(fn: Callable) -> bool:
    """Whether `fn` is called as a reward: it takes prompts, completions or completion_ids, or any keyword
    (**kwargs), which is how TRL passes them. Anything else (TRL's `get_soft_overlong_punishment(max_completion_len,
    soft_punish_cache)`) is a factory."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True  # a builtin or C callable: only callable as it is
    return any(p.name in REWARD_PARAMETERS or p.kind == p.VAR_KEYWORD for p in params)


def call_factory(factory: Callable, args: dict[str, Any], name: str, base_dir: Path, run_dir: Path | None,
                 where: str) -> Any:
    """Call a factory with the recipe's `args`, checked against its signature so that a typo names the
    arguments it takes; `base_dir` / `run_dir` are passed when it declares them and the recipe does not."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None
    args = dict(args)
    shown = signature_text(factory)
    if signature is not None:
        params = signature.parameters
        takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
        allowed = [n for n, p in params.items() if n not in INJECTED and p.kind in (p.KEYWORD_ONLY,
                                                                                       p.POSITIONAL_OR_KEYWORD)]
        for key in args:
            if key not in params and not takes_any:
                hint = closest(key, allowed)
                raise KitError(f"{where}: reward '{name}' has no argument '{key}'"
                               f"{f'; did you mean {hint[0]!r}?' if hint else ''} "
                               f"(it takes: {', '.join(allowed) or 'no arguments'}; {shown})")
        missing = [n for n, p in params.items() if p.default is p.empty and n not in args and n not in INJECTED
                   and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if missing:
            raise KitError(f"{where}: reward '{name}' is a factory, {shown}, and needs args: {', '.join(missing)} "
                           f"(e.g. args: {{{missing[0]}: ...}})")
        for key, value in (("base_dir", base_dir), ("run_dir", run_dir)):
            if key in params and key not in args:
                args[key] = value
    try:
        made = factory(**args)
    except KitError as error:
        raise KitError(f"{where}: reward '{name}': {error.format_message()}") from None
    except (TypeError, ValueError) as error:
        raise KitError(f"{where}: reward '{name}' rejected its args {args}: {error}") from None
    except Exception as error:  # a third-party factory's own failure: one line, not a traceback
        raise KitError(f"{where}: reward factory '{name}' ({shown}) raised {type(error).__name__}: {error}") from None
    if not callable(made):
        raise KitError(f"{where}: reward factory '{name}' ({shown}) returned {type(made).__name__} "
                       f"{short_repr(made)}, not a reward function; a factory returns the callable that scores")
    return made


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_reward(target: Any, spec: dict[str, Any], source: str, base_dir: Path, run_dir: Path | None,
                where: str) -> Callable:
    """The reward callable a spec names: `target` itself, or what it returns when it is a factory (kit's
    @reward_factory, any callable given `args:`, or a callable whose parameters are not a reward's)."""
    name = spec["name"]
    if not callable(target):
        raise KitError(f"{where}: reward '{name}' ({source}) is not callable")
    if getattr(target, "is_reward_factory", False):
        return call_factory(target, spec["args"], name, base_dir, run_dir, where)
    if spec["args"]:
        if is_reward_signature(target) and not factory_args_fit(target, spec["args"]):
            raise KitError(f"{where}: reward '{name}' is a reward function, {signature_text(target)}, not a "
                           f"factory, so it takes no args; remove args:, or name the factory that makes it")
        return call_factory(target, spec["args"], name, base_dir, run_dir, where)
    if not is_reward_signature(target):
        return call_factory(target, {}, name, base_dir, run_dir, where)
    return target


def factory_args_fit(fn: Callable, args: dict[str, Any]) -> bool:
    """Whether every key of `args` names a parameter of `fn` that is not a reward's (a factory with **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return not any(p in params for p in REWARD_PARAMETERS) and all(k in params for k in args)


def load_reward(raw: Any, base_dir: Path, where: str = "rewards", run_dir: Path | None = None) -> LoadedReward:
    spec = normalize_spec(raw, where)
    target, source = find_reward(spec["name"], Path(base_dir), where)
    fn = make_reward(target, spec, source, Path(base_dir), run_dir, where)
    name = spec["name_as"] or getattr(fn, "__name__", None) or spec["name"].rpartition(":")[2]
    declared = declared_range(fn if hasattr(fn, "score_range") else target, where, name)
    return LoadedReward(fn=fn, name=name, weight=float(spec["weight"]), on_error=spec["on_error"], source=source,
                        args=spec["args"], score_range=declared)


def load_rewards(raws: list[Any], base_dir: Path, where: str = "rewards",
                 run_dir: Path | None = None) -> list[LoadedReward]:
    """Every reward of a stage, resolved (imported, factories called), before any model loads; two of one name are
    refused here, naming both sources (TRL logs each reward by its name)."""
    if not isinstance(raws, list):
        raise KitError(f"{where}: 'rewards' must be a list of reward names or mappings")
    loaded = [load_reward(raw, base_dir, f"{where}[{i}]", run_dir=run_dir) for i, raw in enumerate(raws)]
    for index, reward in enumerate(loaded):
        for other_index, other in enumerate(loaded[:index]):
            if other.name == reward.name:
                raise KitError(f"{where}: rewards[{other_index}] ({other.source}) and rewards[{index}] "
                               f"({reward.source}) are both named '{reward.name}'; metrics are logged by name, so "
                               f"give one another name with name_as: (e.g. {{name: {raws_name(raws[index])}, "
                               f"name_as: {reward.name}_2}}), or set __name__ in its factory")
    return loaded


def raws_name(raw: Any) -> str:
    return str(raw["name"] if isinstance(raw, dict) else getattr(raw, "name", raw))


def required_columns(fn: Callable) -> list[str]:
    """Dataset columns a reward needs: its `required_columns` attribute, else the parameters of its signature
    without a default (other than prompts, completions and what the trainer passes)."""
    declared = getattr(fn, "required_columns", None)
    if declared is not None:
        return list(declared)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.name not in TRAINER_ARGUMENTS
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_columns(rewards: list[LoadedReward], columns, where: str, path: str = "the data",
                  mapping_hint: bool = True) -> None:
    """Fail before any generation when a reward needs a column the data does not have."""
    present = set(columns)
    needed = {column for reward in rewards for column in required_columns(reward.fn)}
    for reward in rewards:
        for column in required_columns(reward.fn):
            if column not in present:
                others = sorted(present - needed - {"prompt", "completion", "completion_ids"})
                example = (f"; map yours in the stage's data with e.g. columns: {{{others[0]}: {column}}}"
                           if others and mapping_hint else "")
                raise KitError(f"{where}: reward '{reward.name}' needs column '{column}', which {path} does not "
                               f"have (columns: {', '.join(sorted(present)) or 'none'}){example}")


def check_data(rewards: list[LoadedReward], rows: list[dict[str, Any]], where: str, path: str = "the data",
               mapping_hint: bool = True) -> None:
    """Before any model loads: the columns every reward needs, then each reward's own check of the rows (e.g.
    code_exec refusing a test case it cannot judge), as one line naming the reward, the file and the row."""
    check_columns(rewards, rows[0] if rows else {}, where, path, mapping_hint)
    for reward in rewards:
        check = getattr(reward.fn, "check_rows", None)
        if check is None:
            continue
        try:
            check(rows)
        except ValueError as problem:
            raise KitError(f"{where}: reward '{reward.name}': {path}: {problem}") from None
