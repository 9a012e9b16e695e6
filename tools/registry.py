"""Finding and checking tools, the way rewards are found: a name in the `kit.tools` entry-point group (the built-ins
register there through this package's own pyproject, third-party packages through theirs), `module:function`, or
`path/to/file.py:function` (relative to the recipe file). A factory (marked `@tool_factory`) is called with the
recipe's `args:` (and `base_dir`, the recipe's folder, when it declares it) and returns the tool.

A tool is a plain function with a type hint on every parameter and a Google-style docstring describing each one:
TRL builds the JSON schema the model sees from them (transformers' `get_json_schema`), so a tool it could not
describe is refused here, with the reason, before any model loads. `environment: file.py:Class` names a stateful
environment (TRL's `environment_factory`): a class with `reset` whose public methods are its tools.

Every tool the trainer gets is wrapped by `guard`: arguments that do not fit its signature, an exception (ValueError
for a refusal, anything else for a bug) or running past its time limit become a `ToolError` whose message is the
sentence the model reads back. TRL's GRPOTrainer catches it, puts `{'error': message}` in the tool turn and counts a
tool failure (`tools/failure_frequency`); training goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import signal
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from kitcli.errors import KitError, closest
from rewards.modules import load_named
from rewards.registry import conflicting, distribution_name, factory_args
from rewards.registry import entry_points as entry_points_in

ENTRY_POINT_GROUP = "kit.tools"
BUILTIN_DISTRIBUTION = "lora-kit"
SPEC_KEYS = {"name", "args", "timeout"}
DEFAULT_TIMEOUT = 30.0  # seconds a call may take (the python tool's own sandbox stops code after 5 s)
INJECTED = ("base_dir",)
ENVIRONMENT_HOOKS = ("reset", "get_reward")  # an environment's methods that are not tools (TRL's rule)


class ToolError(Exception):
    """A tool call that failed; the message is what the model reads back."""


def tool_factory(fn: Callable) -> Callable:
    """Mark `fn` as a factory: the recipe's `args` are passed to it and it returns the tool function."""
    fn.is_tool_factory = True
    return fn


@dataclass
class LoadedTool:
    fn: Callable          # the guarded function the trainer calls
    name: str
    source: str
    schema: dict[str, Any]
    args: dict[str, Any] = field(default_factory=dict)
    timeout: float = DEFAULT_TIMEOUT


# --- finding ----------------------------------------------------------------------------------------------------

def entry_points() -> dict[str, metadata.EntryPoint]:
    return entry_points_in(ENTRY_POINT_GROUP)


def tool_catalog() -> list[dict[str, str]]:
    """Every registered tool: name, where it comes from, the args its factory takes ("-" for a plain function),
    its parameters and the first line of its docstring. A tool that fails to import is listed with the error."""
    rows = []
    for name, ep in sorted(entry_points().items()):
        dist = distribution_name(ep)
        row = {"name": name, "source": "built-in" if dist == BUILTIN_DISTRIBUTION else f"{dist} ({ep.value})",
               "args": "-", "parameters": "", "doc": ""}
        try:
            target = ep.load()
        except Exception as error:  # a broken third-party package must not hide the others
            row["doc"] = f"fails to load: {type(error).__name__}: {error}"
            rows.append(row)
            continue
        if getattr(target, "is_tool_factory", False):
            row["args"] = ", ".join(factory_args(target, INJECTED)) or "-"
            row["parameters"] = "(made by the factory)"
        else:
            row["parameters"] = ", ".join(parameters(target))
        doc = inspect.getdoc(target) or ""
        row["doc"] = doc.strip().splitlines()[0].strip().rstrip(".") if doc.strip() else ""
        rows.append(row)
    return rows


def parameters(fn: Callable) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name + (f": {annotation_name(p.annotation)}" if p.annotation is not p.empty else "") for p in params]


def annotation_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def find_object(name: str, base_dir: Path, where: str, what: str = "tool") -> tuple[Any, str]:
    """The object `name` refers to (`module:attr`, `file.py:attr` or, for tools, an entry point) and its source."""
    if ":" in name:
        return load_named(name, base_dir, where, what)
    if what != "tool":
        raise KitError(f"{where}: {what} '{name}' must be module:Class or path/to/file.py:Class")
    eps = entry_points()
    if name not in eps:
        near = closest(name, eps)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise KitError(f"{where}: unknown tool '{name}'.{hint} Known tools: {', '.join(sorted(eps)) or 'none'} (or "
                       f"give module:function or path/to/file.py:function; `kit tools list` describes them)")
    clash = conflicting(name, ENTRY_POINT_GROUP)
    if clash:
        listed = "; ".join(f"{ep.value} ({distribution_name(ep)})" for ep in clash)
        raise KitError(f"{where}: tool '{name}' is registered by more than one package: {listed}; uninstall one, or "
                       f"name the function you mean as module:function")
    try:
        return eps[name].load(), f"entry point {eps[name].value}"
    except Exception as error:
        raise KitError(f"{where}: tool '{name}' ({eps[name].value}) failed to load: {error}") from None


# --- checking ---------------------------------------------------------------------------------------------------

def check_tool(fn: Any, name: str, where: str, method: bool = False) -> dict[str, Any]:
    """The JSON schema TRL will build for `fn`, or a KitError saying why it cannot: not a function, a parameter
    without a type hint, no docstring or a parameter the docstring does not describe."""
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        noun = type(fn).__name__
        kind = "a class" if inspect.isclass(fn) else f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"
        raise KitError(f"{where}: tool '{name}' is {kind}, not a function; a tool is a plain function with type "
                       f"hints and a docstring")
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())[1 if method else 0:]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise KitError(f"{where}: tool '{name}' takes *{p.name}; a tool's parameters are named, each with a type "
                           f"hint (the model fills them from the JSON schema)")
        if p.annotation is p.empty:
            raise KitError(f"{where}: tool '{name}': parameter '{p.name}' has no type hint; TRL builds the tool's "
                           f"JSON schema from them (e.g. def {name}({p.name}: str) -> str)")
    if not (inspect.getdoc(fn) or "").strip():
        raise KitError(f"{where}: tool '{name}' has no docstring; TRL builds the tool's JSON schema from a "
                       f"Google-style docstring (a description, then Args: with one line per parameter)")
    from transformers.utils import get_json_schema

    target = types.MethodType(fn, object()) if method else fn
    try:
        return get_json_schema(target)
    except Exception as error:  # transformers' TypeHintParsingException / DocstringParsingException
        raise KitError(f"{where}: tool '{name}': TRL cannot build its JSON schema: {error}") from None


# --- guarding ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def time_limit(seconds: float, name: str):
    """Raise ToolError in the calling thread after `seconds` (SIGALRM; only in the main thread and when no other
    timer is running; elsewhere the call is not limited)."""
    usable = (threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
              and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))
    if not usable or not seconds:
        yield
        return

    def expire(signum, frame):
        raise ToolError(f"{name} took longer than its limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def bad_arguments(signature: inspect.Signature, name: str, args: tuple, kwargs: dict) -> str | None:
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        takes = ", ".join(p.name for p in signature.parameters.values() if p.name != "self") or "no arguments"
        return f"{name} got arguments {kwargs!r:.200}: {error} (it takes: {takes})"
    return None


def failure(name: str, error: BaseException) -> ToolError:
    if isinstance(error, ToolError):
        return error
    if isinstance(error, ValueError):  # a tool's refusal: its sentence is for the model
        return ToolError(f"{name}: {error}")
    return ToolError(f"{name} failed: {type(error).__name__}: {error}")


def guard(fn: Callable, name: str, timeout: float = DEFAULT_TIMEOUT) -> Callable:
    """`fn` with its signature and docstring (so TRL's schema is the same), whose every failure is a ToolError."""
    signature = inspect.signature(fn)
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def guarded_async(*args, **kwargs):
            problem = bad_arguments(signature, name, args, kwargs)
            if problem:
                raise ToolError(problem)
            try:
                return await asyncio.wait_for(fn(*args, **kwargs), timeout or None)
            except asyncio.TimeoutError:
                raise ToolError(f"{name} took longer than its limit of {timeout:g} s") from None
            except Exception as error:
                raise failure(name, error) from None

        return guarded_async

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        problem = bad_arguments(signature, name, args, kwargs)
        if problem:
            raise ToolError(problem)
        try:
            with time_limit(timeout, name):
                return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise  # the user's Ctrl-C stops the run as always
        except BaseException as error:  # SystemExit too: a tool never ends training
            raise failure(name, error) from None

    return guarded


# --- loading ----------------------------------------------------------------------------------------------------

def normalize_spec(raw: Any, where: str) -> dict[str, Any]:
    """A tool as a mapping: a name, a mapping, or a validated spec read by its attributes (the kit's ToolSpec)."""
    if isinstance(raw, str):
        raw = {"name": raw}
    elif not isinstance(raw, dict) and hasattr(raw, "name"):
        raw = {key: getattr(raw, key) for key in SPEC_KEYS if hasattr(raw, key)}
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise KitError(f"{where}: each tool is a name or a mapping with 'name' (and optional args, timeout)")
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        near = closest(unknown[0], SPEC_KEYS)
        raise KitError(f"{where}: tool '{raw['name']}': unknown key '{unknown[0]}'"
                       f"{f'; did you mean {near[0]!r}?' if near else ''} (allowed: {', '.join(sorted(SPEC_KEYS))})")
    args, timeout = raw.get("args") or {}, raw.get("timeout", DEFAULT_TIMEOUT)
    if not isinstance(args, dict):
        raise KitError(f"{where}: tool '{raw['name']}': args must be a mapping of keyword arguments")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise KitError(f"{where}: tool '{raw['name']}': timeout must be seconds from 0 to 3600, got {timeout!r}")
    return {"name": raw["name"], "args": args, "timeout": float(timeout)}


def call_factory(factory: Callable, args: dict[str, Any], name: str, base_dir: Path, where: str) -> Any:
    params = inspect.signature(factory).parameters
    allowed = [n for n in params if n not in INJECTED]
    for key in args:
        if key not in params:
            near = closest(key, allowed)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise KitError(f"{where}: tool '{name}' has no argument '{key}'{hint} (it takes: "
                           f"{', '.join(allowed) or 'no arguments'})")
    missing = [n for n, p in params.items() if p.default is p.empty and n not in args and n not in INJECTED]
    if missing:
        raise KitError(f"{where}: tool '{name}' needs args: {', '.join(missing)} (e.g. tools: [{{name: {name}, "
                       f"args: {{{missing[0]}: ...}}}}])")
    if "base_dir" in params and "base_dir" not in args:
        args = {**args, "base_dir": base_dir}
    try:
        return factory(**args)
    except KitError as error:
        raise KitError(f"{where}: tool '{name}': {error.format_message()}") from None
    except (TypeError, ValueError) as error:
        raise KitError(f"{where}: tool '{name}' rejected its args {args}: {error}") from None


def load_tool(raw: Any, base_dir: Path, where: str = "tools") -> LoadedTool:
    spec = normalize_spec(raw, where)
    target, source = find_object(spec["name"], Path(base_dir), where)
    if getattr(target, "is_tool_factory", False):
        fn = call_factory(target, spec["args"], spec["name"], Path(base_dir), where)
    elif spec["args"]:
        raise KitError(f"{where}: tool '{spec['name']}' takes no args (it is not a @tool_factory)")
    else:
        fn = target
    name = getattr(fn, "__name__", None) or spec["name"].rpartition(":")[2]
    schema = check_tool(fn, name, where)
    return LoadedTool(fn=guard(fn, name, spec["timeout"]), name=name, source=source, schema=schema,
                      args=spec["args"], timeout=spec["timeout"])


def load_tools(raws: Any, base_dir: Path, where: str = "tools") -> list[LoadedTool]:
    if not isinstance(raws, list):
        raise KitError(f"{where}: 'tools' must be a list of tool names or mappings")
    loaded = [load_tool(raw, base_dir, f"{where}[{i}]") for i, raw in enumerate(raws)]
    check_names([(t.name, t.source) for t in loaded], where)
    return loaded


def check_names(named: list[tuple[str, str]], where: str) -> None:
    """Two tools the model would call by the same name: refused, naming both."""
    seen: dict[str, str] = {}
    for name, source in named:
        if name in seen:
            raise KitError(f"{where}: two tools are named '{name}' ({seen[name]} and {source}); the model calls a "
                           f"tool by its name, so rename one")
        seen[name] = source


def environment_methods(cls: type) -> dict[str, Callable]:
    """The tools of an environment class: its public functions other than reset and get_reward (as TRL lists them)."""
    return {n: f for n, f in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not n.startswith("_") and n not in ENVIRONMENT_HOOKS}


def load_environment(name: str, base_dir: Path, where: str = "environment", tools: list[LoadedTool] = (),
                     timeout: float = DEFAULT_TIMEOUT) -> type:
    """The environment class `name` refers to, checked (a class with `reset`, each tool method describable, no name
    shared with a tool), as a subclass whose tool methods are guarded."""
    if not isinstance(name, str):
        raise KitError(f"{where}: environment must be module:Class or path/to/file.py:Class")
    cls, source = find_object(name, Path(base_dir), where, what="environment")
    if not inspect.isclass(cls):
        raise KitError(f"{where}: environment '{name}' is a {type(cls).__name__}, not a class; TRL's "
                       f"environment_factory makes one instance per rollout from a class with reset()")
    if not callable(getattr(cls, "reset", None)):
        raise KitError(f"{where}: environment '{name}' has no reset method; TRL calls reset() at the start of each "
                       f"rollout (def reset(self, **kwargs) -> str | None)")
    methods = environment_methods(cls)
    if not methods:
        raise KitError(f"{where}: environment '{name}' has no public methods, so the model has no tool to call")
    for method_name, fn in methods.items():
        check_tool(fn, f"{cls.__name__}.{method_name}", where, method=True)
    check_names([(t.name, t.source) for t in tools] + [(n, f"{source}.{n}") for n in methods], where)
    guarded = {n: guard(fn, n, timeout) for n, fn in methods.items()}

    def reset(self, *args, **kwargs):
        """The environment's own reset; a fault in it stops the stage in one line naming the environment (it is
        the user's code, not a tool call the model made, so it is not returned to the model)."""
        try:
            return cls.reset(self, *args, **kwargs)
        except Exception as error:  # any fault in the user's code
            raise KitError(f"environment '{name}' reset() raised {type(error).__name__}: {error}; fix reset (TRL "
                           f"calls it at the start of each rollout, with the row's columns)") from None

    return type(cls.__name__, (cls,), {**guarded, "reset": reset, "__module__": cls.__module__,
                                       "__doc__": cls.__doc__})
