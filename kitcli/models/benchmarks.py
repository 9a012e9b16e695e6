"""Benchmarks through lm-evaluation-harness (PyPI `lm-eval`): the kit loads the model (a base, or a base with a
stage's adapter, as `kit chat` does) and hands it to lm-eval's `HFLM`; lm-eval builds the prompts, generates or
scores, and computes the task's metrics.

    kit eval tiny --tasks kit_arithmetic --include-path examples/benchmarks --apply-chat-template --limit 20
    kit eval runs/tiny-sft-20261202-120000 --stage sft --tasks gsm8k --limit 50

Tasks are names from lm-eval's registry (`gsm8k`, `minerva_math`), names defined by the YAML files of an
`include_path` folder (lm-eval's `TaskManager(include_path=...)`; a local YAML + JSONL works offline) or paths to
task YAML files. Every name is checked, and every task's dataset loaded, before a model loads: an unknown name, or a
hub dataset that is not cached while the hub cannot be reached, is one line. The settings lm-eval would default
(seeds, bootstrap iterations, few-shot as multi-turn) are passed explicitly and recorded with the scores.
Scores are flattened to `benchmark/<task>/<metric>,<filter>` keys, the form the before/after table reads.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kitcli.errors import KitError, closest

LM_EVAL_PIN = "lm-eval==0.4.13"
INSTALL_HINT = "pip install 'lora-kit[benchmarks]' (from a checkout: pip install -e '.[benchmarks]')"
PREFIX = "benchmark/"
# lm-eval's own defaults (lm_eval.evaluator.simple_evaluate), passed explicitly so that a change of theirs does not
# move a score silently
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234, "fewshot_random_seed": 1234}
BOOTSTRAP_ITERS = 100_000
FILE_LOADERS = ("json", "csv", "parquet", "text", "arrow")  # `datasets` loaders that read local files


@dataclass(frozen=True)
class BenchmarkSettings:
    """What `kit eval --tasks` and an eval stage with `tasks:` pass to lm-eval (recorded with the scores)."""

    tasks: tuple[str, ...]
    include_path: tuple[str, ...] = ()
    limit: int | None = None
    num_fewshot: int | None = None
    batch_size: int = 32
    apply_chat_template: bool = False
    max_length: int | None = None  # the model's max_seq_length: lm-eval cuts longer contexts from the left

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "tasks": list(self.tasks), "include_path": list(self.include_path),
                "fewshot_as_multiturn": self.apply_chat_template, "bootstrap_iters": BOOTSTRAP_ITERS, **SEEDS}


@dataclass
class LoadedTasks:
    """The requested tasks, built (their datasets loaded) by lm-eval's TaskManager."""

    names: list[str]
    manager: Any
    objects: list[Any] = field(default_factory=list)


def task_names(values: Any, where: str) -> tuple[str, ...]:
    """`gsm8k,minerva_math` (repeatable) or a list: the names in order, each once."""
    raw = [values] if isinstance(values, str) else list(values or [])
    names: list[str] = []
    for value in raw:
        if not isinstance(value, str):
            raise KitError(f"{where}: a task is a name (e.g. gsm8k) or a task YAML file, got {value!r}")
        names += [n.strip() for n in value.split(",") if n.strip() and n.strip() not in names]
    if not names:
        raise KitError(f"{where}: no task named; e.g. --tasks gsm8k,minerva_math (lm-eval's task names), or the "
                       f"name of a task in an --include-path folder")
    return tuple(names)


def require_lm_eval(where: str) -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise KitError(f"{where}: benchmarks run through lm-evaluation-harness, which is not installed here; "
                       f"{INSTALL_HINT}")


def is_task_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).expanduser().is_file()


@functools.lru_cache(maxsize=8)
def _manager(include_path: tuple[str, ...], defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_path) or None, include_defaults=defaults)


def task_manager(names: tuple[str, ...], include_path: tuple[str, ...]):
    """lm-eval's TaskManager. Indexing its registry (about 14,000 YAML files) takes seconds, so tasks that all come
    from the include_path folders (or are YAML files) are found in an index of those folders alone."""
    if include_path:
        local = _manager(include_path, False)
        if all(name in local.all_tasks or is_task_file(name) for name in names):
            return local
    if all(is_task_file(name) for name in names):
        return _manager(include_path, False)
    return _manager(include_path, True)


def check_task_names(names: tuple[str, ...], manager, where: str) -> None:
    import difflib

    for name in names:
        if name in manager.all_tasks or is_task_file(name):
            continue
        near = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6) or closest(name, manager.all_tasks)
        if name.endswith((".yaml", ".yml")):
            raise KitError(f"{where}: task file '{name}' does not exist")
        hint = f"; closest: {', '.join(near)}" if near else ""
        raise KitError(f"{where}: unknown lm-eval task '{name}'{hint} (lm-eval's registry"
                       f"{' and ' + ', '.join(manager.include_path) if manager.include_path else ''}; "
                       f"`python -m lm_eval ls tasks` lists them)")


def dataset_sources(name: str, index: dict, seen: set[str] | None = None) -> list[str]:
    """The datasets a task, group or tag reads, from lm-eval's index (no dataset is loaded)."""
    seen = seen if seen is not None else set()
    entry = index.get(name)
    if entry is None or name in seen:
        return []
    seen.add(name)
    config = entry.cfg or {}
    members = list(entry.tags) if entry.kind.name == "TAG" else []  # a task's or group's tags are its labels
    if isinstance(config.get("task"), list):  # a group's members
        members += [m if isinstance(m, str) else m.get("task") for m in config["task"]]
    found = [s for m in members if isinstance(m, str) for s in dataset_sources(m, index, seen)]
    path = config.get("dataset_path")
    if isinstance(path, str):
        if path in FILE_LOADERS:
            files = (config.get("dataset_kwargs") or {}).get("data_files")
            found.append(f"the local file(s) {files}")
        else:
            found.append(f"the hub dataset '{path}'" + (f" (config '{config['dataset_name']}')"
                                                        if config.get("dataset_name") else ""))
    return list(dict.fromkeys(found))


def hub_switched_off() -> str | None:
    import os

    flags = [k for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
             if os.environ.get(k, "").upper() in ("1", "ON", "TRUE", "YES")]
    return f"{flags[0]} is set" if flags else None


def load_tasks(settings: BenchmarkSettings, where: str) -> LoadedTasks:
    """Check the names and build every task (lm-eval loads its dataset here), before any model loads."""
    from kitcli import libraries

    require_lm_eval(where)
    for folder in settings.include_path:
        if not Path(folder).is_dir():
            raise KitError(f"{where}: include_path '{folder}' is not a folder; give a folder of lm-eval task YAML "
                           f"files")
    with libraries.library_output(), lm_eval_logs():
        manager = task_manager(settings.tasks, settings.include_path)
    check_task_names(settings.tasks, manager, where)
    loaded = LoadedTasks(list(settings.tasks), manager)
    for name in settings.tasks:
        try:
            with libraries.library_output(), lm_eval_logs():
                built = manager.load([name])
        except Exception as error:  # noqa: BLE001  (a dataset that cannot be read: named in one line)
            raise task_error(name, manager, error, where) from None
        group = built["groups"].get(name)  # a group whole, so that lm-eval computes its aggregate
        loaded.objects += [group] if group is not None else list(built["tasks"].values())
    return loaded


def task_error(name: str, manager, error: Exception, where: str) -> KitError:
    text = " ".join(str(error).split())[:300] or type(error).__name__
    sources = dataset_sources(name, manager.task_index) if name in manager.task_index else []
    needs = f" needs {', '.join(sources[:3])}{' and more' if len(sources) > 3 else ''}" if sources else ""
    offline = hub_switched_off()
    unreachable = isinstance(error, ConnectionError) or re.search(r"Couldn't reach|OfflineModeIsEnabled|"
                                                                   r"LocalEntryNotFound|ConnectionError", text)
    if unreachable:
        why = f"the hub cannot be reached ({offline})" if offline else "the hub cannot be reached"
        return KitError(f"{where}: task '{name}'{needs}, which is not in the local datasets cache, and {why}; run "
                        f"it once where there is a network (the datasets cache keeps it), or use a local task (a "
                        f"YAML + JSONL in an --include-path folder, docs/benchmarks.md)")
    if isinstance(error, FileNotFoundError) or "doesn't exist" in text or "Unable to find" in text:
        return KitError(f"{where}: task '{name}'{needs}, which cannot be read ({text}); lm-eval reads a task's "
                        f"data_files relative to the working directory ({Path.cwd()}), or give absolute paths")
    return KitError(f"{where}: task '{name}' could not be built by lm-eval ({type(error).__name__}: {text})")


# --- running ------------------------------------------------------------------------------------------------------

class ProgressHook:
    """Takes lm-eval's per-request cache hook (called once per answered request) and advances the kit's bar."""

    def __init__(self, bar):
        self.bar, self.task = bar, None

    def start(self, what: str, total: int) -> None:
        if self.bar is not None:
            if self.task is not None:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(what, total=total)

    def add_partial(self, attr, req, res) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.advance(self.task)


def kit_lm(model, tokenizer, settings: BenchmarkSettings, hook: ProgressHook):
    """lm-eval's HFLM around the loaded model; its tqdm bars are off and each request advances `hook`."""
    from lm_eval.models.huggingface import HFLM

    class KitLM(HFLM):
        def generate_until(self, requests, disable_tqdm: bool = False):
            hook.start("generating", len(requests))
            return super().generate_until(requests, disable_tqdm=True)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            hook.start("scoring choices", len(requests))
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            hook.start("scoring texts", len(requests))
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

    lm = KitLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=settings.batch_size,
               max_length=settings.max_length)
    lm.set_cache_hook(hook)
    return lm


@contextlib.contextmanager
def progress_bar(console):
    """A bar with the count and ETA of the requests on a terminal; nothing otherwise (CI, a pipe, --json)."""
    if console is None or not console.is_terminal:
        yield None
        return
    from rich import progress
    from rich.console import Console

    # bound to the stream now: library output is redirected while lm-eval runs
    bound = Console(file=console.file, force_terminal=True, width=console.width, highlight=False)
    with progress.Progress(progress.TextColumn("  lm-eval {task.description}"), progress.BarColumn(bar_width=30),
                           progress.MofNCompleteColumn(), progress.TimeElapsedColumn(), progress.TextColumn("eta"),
                           progress.TimeRemainingColumn(), console=bound, redirect_stdout=False,
                           redirect_stderr=False) as bar:
        yield bar


@contextlib.contextmanager
def lm_eval_logs():
    """lm-eval's log lines (a pre-built model, the seeds, --limit is for testing) go where library output goes
    (kitcli/libraries.py), not through a handler bound to the terminal earlier."""
    import logging
    import sys

    logger = logging.getLogger("lm_eval")
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [logging.StreamHandler(sys.stderr)], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = saved


def run_benchmarks(model, tokenizer, tasks: LoadedTasks, settings: BenchmarkSettings, *, console=None,
                   where: str = "kit eval") -> dict[str, Any]:
    """lm-eval's `simple_evaluate` on the loaded model: its results dict (results, configs, n-samples, samples)."""
    from lm_eval import evaluator

    from kitcli import libraries

    # lm-eval records `git describe` of the working directory (whatever repository one stands in; git's "fatal: not
    # a git repository" on the terminal outside one); the kit records lm-eval's version instead
    git_hash, evaluator.get_git_commit_hash = evaluator.get_git_commit_hash, lambda: None
    with progress_bar(console) as bar:
        hook = ProgressHook(bar)
        with libraries.library_output(), lm_eval_logs():
            lm = kit_lm(model, tokenizer, settings, hook)
            try:
                results = evaluator.simple_evaluate(
                    model=lm, tasks=tasks.objects, task_manager=tasks.manager, limit=settings.limit,
                    num_fewshot=settings.num_fewshot, batch_size=settings.batch_size,
                    apply_chat_template=settings.apply_chat_template,
                    fewshot_as_multiturn=settings.apply_chat_template, bootstrap_iters=BOOTSTRAP_ITERS,
                    log_samples=True, **SEEDS)
            except ValueError as error:  # e.g. a task that runs generated code, or a chat template missing
                raise KitError(f"{where}: lm-eval refused: {' '.join(str(error).split())[:300]}") from None
            finally:
                evaluator.get_git_commit_hash = git_hash
    return results


# --- reading the results ------------------------------------------------------------------------------------------

def number(value: Any) -> bool:
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's floats too


def task_scores(results: dict[str, Any], names: list[str]) -> dict[str, dict[str, float]]:
    """{task: {"metric,filter": value}} for the requested names (a group's aggregate, not each of its subtasks;
    a tag's tasks each), stderr left out."""
    table = {**results.get("results", {}), **results.get("groups", {})}
    shown = {}
    for name in names:
        rows = [name] if name in table else [t for t in results.get("results", {}) if t not in shown]
        for row in rows:
            scores = {k: float(v) for k, v in table[row].items() if number(v) and "," in k and "_stderr" not in k}
            if scores:
                shown[row] = scores
    return shown


def flat_scores(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"{PREFIX}{task}/{key}": value for task, metrics in scores.items() for key, value in metrics.items()}


def sample_count(results: dict[str, Any]) -> int:
    return sum(int(n.get("effective", 0)) for n in results.get("n-samples", {}).values())


def headline(scores: dict[str, dict[str, float]], n: int) -> str:
    parts = [f"{task} " + ", ".join(f"{key.replace(',none', '')} {value:.3f}" for key, value in metrics.items())
             for task, metrics in scores.items()]
    return f"{'; '.join(parts)} (lm-eval, {n} samples)"


def sample_records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per scored document: the prompt lm-eval built, the answer it scored, the target, each metric;
    `correct` where the task scores exact match (as the kit's eval samples have)."""
    records = []
    for task, samples in results.get("samples", {}).items():
        for sample in sorted(samples, key=lambda s: s.get("doc_id", 0)):
            arguments = sample.get("arguments") or [[""]]
            filtered = sample.get("filtered_resps") or [""]
            record = {"task": task, "doc_id": sample.get("doc_id"), "prompt": arguments[0][0],
                      "completion": filtered[0] if isinstance(filtered[0], str) else str(filtered[0]),
                      "answer": sample.get("target"),
                      "metrics": {m: float(sample[m]) for m in sample.get("metrics", []) if number(sample.get(m))}}
            if "exact_match" in record["metrics"]:
                record["correct"] = record["metrics"]["exact_match"] == 1.0
            records.append(record)
    return records


def results_record(results: dict[str, Any], settings: BenchmarkSettings, scores) -> dict[str, Any]:
    """What is kept on disk per task: scores with stderr, sample counts, the settings and lm-eval's task config."""
    from importlib import metadata

    version = metadata.version("lm-eval")
    return {task: {"scores": metrics,
                   "stderr": {k: v for k, v in {**results.get("results", {}), **results.get("groups", {})}
                              .get(task, {}).items() if "_stderr" in k and number(v)},
                   "n": results.get("n-samples", {}).get(task, {}).get("effective"),
                   "settings": settings.record(), "lm_eval": version,
                   "config": results.get("configs", {}).get(task)}
            for task, metrics in scores.items()}
