"""`kit eval` (score a model on a held-out file, or on lm-evaluation-harness tasks) and `kit report` (write a
run's report.md and plots).

    kit eval runs/tiny-sft-20261202-120000/sft --data examples/data/arithmetic_eval.jsonl
    kit eval runs/tiny-grpo-20261202-130000 --data examples/data/arithmetic_eval.jsonl --reward exact_match \\
        --reward '{name: format, args: {tags: [answer]}}' --n 8 --temperature 0.8
    kit eval tiny --data examples/data/arithmetic_eval.jsonl
    kit eval runs/tiny-sft-20261202-120000 --stage sft --tasks kit_arithmetic --include-path examples/benchmarks \\
        --apply-chat-template --limit 20                 (lm-eval; scores to RUN/benchmarks/sft.json)
    kit report runs/tiny-sft-20261202-120000

The target is a run directory (its last training stage; `--stage NAME` another, `--stage base` the run's base
model), a stage directory inside one (that stage's adapter on the run's base model, as recipe.lock.yaml names it),
or a model: a hub name, a local directory, a GGUF file, `smollm2-135m` or `tiny`. With `--tasks` a run's stage loads
as `kit chat` loads it (kitcli/commands/chat.py) and lm-eval scores it (kitcli/models/benchmarks.py,
docs/benchmarks.md). Heavy libraries load only when a command runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from kitcli.errors import KitError, did_you_mean
from kitcli.recipe.stage_types import is_policy, spec_output
from kitcli.rundir import RunDir, StageDir, find_run, read_run_lock

DATA_ONLY = ("rewards", "n", "temperature", "max_new_tokens", "show", "seed")
TASKS_ONLY = ("include_path", "num_fewshot", "apply_chat_template")


def has_model(stage_dir: Path) -> bool:
    return StageDir(stage_dir).saved_model() is not None


def resolve_target(target: str) -> dict[str, Any]:
    """{model: settings dict, init_dir, label, run_dir, seed} for a run, a stage directory or a model name."""
    from kitcli.recipe.load import DEFAULT_MODEL, validate_model

    path = Path(target).expanduser()
    if path.is_dir() and RunDir(path).is_run():
        lock = read_run_lock(RunDir(path))
        stages = [s for s in lock.get("recipe", {}).get("stages", []) if is_policy(s.get("type"))]
        trained = [s["name"] for s in stages if has_model(path / s["name"])]
        if not trained:
            raise KitError(f"{path}: no stage of this run has saved a model yet (looked for <stage>/adapter or "
                           f"<stage>/model in {', '.join(s['name'] for s in stages) or 'no training stage'}); finish "
                           f"the run, or give a model name")
        return {"model": lock["recipe"]["model"], "init_dir": path / trained[-1], "label": f"{path.name}/{trained[-1]}",
                "run_dir": path, "seed": lock.get("seed", 42)}
    if path.is_dir() and RunDir(path.parent).is_run():
        lock = read_run_lock(RunDir(path.parent))
        stages = {s["name"]: s for s in lock.get("recipe", {}).get("stages", [])}
        kind = stages.get(path.name, {}).get("type")
        if spec_output(kind) == "scorer":
            raise KitError(f"{path}: a reward stage is a scorer, not a policy; evaluate a policy with it as a reward: "
                           f"--reward '{{name: reward_model, args: {{path: {StageDir(path).merged}}}}}'")
        if not has_model(path):
            why = f"{'an' if str(kind)[:1] in 'aeiou' else 'a'} {kind} stage saves no model" \
                if spec_output(kind) == "none" else \
                "it has no adapter/ or model/ (not finished?)"
            trained = [n for n, s in stages.items()
                       if is_policy(s.get("type")) and has_model(path.parent / n)]
            raise KitError(f"{path}: cannot evaluate this stage: {why}; give a training stage of the run"
                           f"{' (' + ', '.join(trained) + ')' if trained else ''}")
        return {"model": lock["recipe"]["model"], "init_dir": path, "label": f"{path.parent.name}/{path.name}",
                "run_dir": path.parent, "seed": lock.get("seed", 42)}
    if path.is_dir() and not (path / "config.json").is_file():
        raise KitError(f"{path} is neither a kit run directory (recipe.lock.yaml), a stage directory in one, nor a "
                       f"model directory (config.json)")
    model = validate_model(target, "kit eval", Path.cwd())
    return {"model": {**DEFAULT_MODEL, **model}, "init_dir": None, "label": target, "run_dir": None, "seed": 42}


def with_stage(target: str, stage: str | None, tasks: bool = False) -> dict[str, Any]:
    """`--stage NAME` (or `base`, the run's base model) of the run directory TARGET. With --tasks a stage is
    resolved as `kit chat` resolves it (`policy`: it loads through chat's loader)."""
    path = Path(target).expanduser()
    if stage is None:
        if tasks and find_run(path) is not None:
            return policy_target(path)
        return resolve_target(target)
    if not (path.is_dir() and RunDir(path).is_run()):
        raise KitError(f"--stage {stage}: TARGET must be a run directory (with recipe.lock.yaml); '{target}' is not "
                       f"one{' (give RUN_DIR --stage NAME, or RUN_DIR/NAME alone)' if find_run(path) else ''}")
    lock = read_run_lock(RunDir(path))
    if stage == "base":
        return {"model": lock["recipe"]["model"], "init_dir": None, "label": f"{path.name}/base", "run_dir": path,
                "seed": lock.get("seed", 42), "name": "base"}
    names = [s["name"] for s in lock["recipe"].get("stages", [])]
    if stage not in names:
        raise KitError(f"--stage: {path} has no stage '{stage}'{did_you_mean(stage, names)} (stages: "
                       f"{', '.join(names)}; or base, the run's base model)")
    return policy_target(path / stage) if tasks else resolve_target(str(path / stage))


def policy_target(path: Path) -> dict[str, Any]:
    from kitcli.commands.chat import resolve_policy_stage

    policy = resolve_policy_stage(path, "eval")
    return {"model": policy.model, "init_dir": policy.stage_dir, "label": f"{policy.run_dir.name}/{policy.name}",
            "run_dir": policy.run_dir, "seed": policy.recipe.get("seed", 42), "name": policy.name, "policy": policy}


def load_target(resolved: dict[str, Any], *, max_seq_length: int | None, seed: int, log):
    """A run's stage through `kit chat`'s loader; a model name (or a run's base) through the same load_policy."""
    from kitcli.models.backend import load_policy

    if resolved.get("policy") is not None:
        from kitcli.commands.chat import load_stage_model

        return load_stage_model(resolved["policy"], log=log)
    model = resolved["model"]
    return load_policy(model["name"], max_seq_length=max_seq_length or model["max_seq_length"],
                       load_in_4bit=model["load_in_4bit"], lora=None, backend=model.get("backend", "auto"),
                       dtype=model.get("dtype", "auto"), seed=seed, init_from=resolved["init_dir"],
                       trust_remote_code=model.get("trust_remote_code", False), trainable=False,
                       chat_template=model.get("chat_template"), log=log, label="evaluated model")


def refuse_options(mode: str, names: tuple[str, ...]) -> None:
    from click.core import ParameterSource

    context = click.get_current_context()
    for name in names:
        if context.get_parameter_source(name) not in (ParameterSource.DEFAULT, None):
            option = next(p for p in context.command.params if p.name == name).opts[0]
            other = "--data" if mode == "--tasks" else "--tasks"
            raise KitError(f"{option} applies to {other}, not to {mode}; remove it")


def parse_reward(text: str) -> Any:
    """A reward name / module:function / file.py:function, or a YAML mapping {name: ..., args: {...}, weight: ...}."""
    if text.strip().startswith("{"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            raise KitError(f"--reward '{text}': not a valid YAML mapping; e.g. "
                           f"--reward '{{name: format, args: {{tags: [answer]}}}}'") from None
    return text


@click.command("eval")
@click.argument("target")
@click.option("--data", default=None, help="Held-out file (JSONL/JSON/CSV/Parquet) with a prompt column, and an "
                                           "answer column for exact match.")
@click.option("--tasks", multiple=True, metavar="NAMES",
              help="Instead of --data: lm-evaluation-harness tasks (comma-separated, repeatable): lm-eval's names "
                   "(gsm8k, minerva_math), tasks of an --include-path folder, or task YAML files.")
@click.option("--stage", default=None, help="With a run directory: the stage to evaluate, or 'base' (the run's "
                                            "base model).")
@click.option("--include-path", multiple=True, type=click.Path(file_okay=False),
              help="With --tasks: a folder of local lm-eval task YAML files (repeatable).")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None,
              help="With --tasks: few-shot examples per question (default: each task's own).")
@click.option("--apply-chat-template", is_flag=True,
              help="With --tasks: format each prompt with the model's chat template.")
@click.option("--reward", "rewards", multiple=True, metavar="NAME",
              help="A reward to average (repeatable): a name (`kit rewards list`), module:function, "
                   "file.py:function, or a YAML mapping '{name: format, args: {...}, weight: 0.5}'.")
@click.option("--n", "n", type=int, default=1, show_default=True, help="Samples per prompt (pass@k for k <= n).")
@click.option("--temperature", type=float, default=None,
              help="Sampling temperature (default 0, greedy; 1.0 when --n > 1).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--batch-size", type=int, default=32, show_default=True, help="Prompts (or lm-eval requests) per "
                                                                             "batch.")
@click.option("--limit", type=int, default=None, help="Use only the first N rows (of each task).")
@click.option("--seed", type=int, default=None, help="Sampling seed (default: the run's seed, else 42).")
@click.option("--show", type=int, default=3, show_default=True, help="Print this many scored samples.")
@click.option("--max-seq-length", type=int, default=None, help="For a model name (default 1024).")
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None,
              help="Write eval.json (the scores) and samples.jsonl (every completion) to this directory "
                   "(with --tasks: benchmarks.json and samples.jsonl).")
@click.option("--json", "as_json", is_flag=True, help="Print the scores as one JSON object on stdout.")
def eval_command(target: str, data: str | None, tasks: tuple[str, ...], stage: str | None,
                 include_path: tuple[str, ...], num_fewshot: int | None, apply_chat_template: bool,
                 rewards: tuple[str, ...], n: int, temperature: float | None, max_new_tokens: int, batch_size: int,
                 limit: int | None, seed: int | None, show: int, max_seq_length: int | None, output: str | None,
                 as_json: bool) -> None:
    """Score a model on a held-out file or lm-eval tasks: TARGET is RUN_DIR[/STAGE] or a MODEL (hub name,
    directory, GGUF file, 'tiny')."""
    from rich.console import Console

    if (data is None) == (not tasks):
        raise KitError("kit eval scores a held-out file (--data FILE) or lm-evaluation-harness tasks (--tasks "
                       f"NAMES); give {'one' if data is None else 'one of them, not both'}")
    if limit is not None and limit <= 0:
        raise KitError(f"--limit must be a positive integer, got {limit}")
    if batch_size <= 0:
        raise KitError(f"--batch-size must be a positive integer, got {batch_size}")
    console = Console(highlight=False, stderr=as_json)
    if tasks:
        refuse_options("--tasks", DATA_ONLY)
        summary = eval_tasks(with_stage(target, stage, tasks=True), tasks, include_path=include_path,
                             num_fewshot=num_fewshot, apply_chat_template=apply_chat_template, batch_size=batch_size,
                             limit=limit, max_seq_length=max_seq_length, output=output, as_json=as_json,
                             console=console)
        return finish(summary, console, as_json)
    refuse_options("--data", TASKS_ONLY)
    from kitcli.recipe.load import validate_data_spec
    from kitcli.stages.eval import check_eval_rows, check_generation, load_eval_rewards

    resolved = with_stage(target, stage)
    settings = check_generation({"n": n, "temperature": temperature if temperature is not None else
                                 (1.0 if n > 1 else 0.0), "max_new_tokens": max_new_tokens,
                                 "batch_size": batch_size, "show": show}, "kit eval")
    spec = validate_data_spec({"path": data, "limit": limit}, "--data", Path.cwd())
    from kitcli.data.rows import read_rows

    rows = read_rows(spec, "--data")
    specs = [parse_reward(r) for r in rewards]
    loaded_rewards = load_eval_rewards(specs, Path.cwd(), "--reward", resolved["run_dir"])
    check_eval_rows(rows, loaded_rewards, "kit eval", spec.path)

    import contextlib

    from kitcli.stages.eval import evaluate_rows, write_samples

    def log(message: str) -> None:
        console.print(message, highlight=False, markup=False, soft_wrap=True)

    run_seed = seed if seed is not None else resolved["seed"]
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        loaded = load_target(resolved, max_seq_length=max_seq_length, seed=run_seed, log=log)
        summary, records = evaluate_rows(loaded.model, loaded.tokenizer, rows, settings, loaded_rewards,
                                         seed=run_seed, log=log, where="kit eval")
    summary = {"model": resolved["label"], "data": spec.path, **summary}
    if output:
        out = Path(output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(summary, indent=2, default=str))
        write_samples(StageDir(out).samples, records)
        log(f"wrote {out / 'eval.json'} and {out / 'samples.jsonl'}")
    finish(summary, console, as_json)


def eval_tasks(resolved: dict[str, Any], tasks: tuple[str, ...], *, include_path: tuple[str, ...],
               num_fewshot: int | None, apply_chat_template: bool, batch_size: int, limit: int | None,
               max_seq_length: int | None, output: str | None, as_json: bool, console) -> dict[str, Any]:
    """lm-eval's tasks on the target: names and datasets checked first, then the model loads; the scores go to
    RUN/benchmarks/<stage or base>.json for a run (the report's before/after table reads them) and to --output."""
    import contextlib

    from kitcli.models import benchmarks

    settings = benchmarks.BenchmarkSettings(
        tasks=benchmarks.task_names(list(tasks), "--tasks"), include_path=tuple(str(Path(p).expanduser().resolve())
                                                                               for p in include_path),
        limit=limit, num_fewshot=num_fewshot, batch_size=batch_size, apply_chat_template=apply_chat_template,
        max_length=max_seq_length or resolved["model"]["max_seq_length"])
    loaded_tasks = benchmarks.load_tasks(settings, "kit eval --tasks")

    def log(message: str) -> None:
        console.print(message, highlight=False, markup=False, soft_wrap=True)

    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        loaded = load_target(resolved, max_seq_length=max_seq_length, seed=resolved["seed"], log=log)
        results = benchmarks.run_benchmarks(loaded.model, loaded.tokenizer, loaded_tasks, settings, console=console,
                                            where="kit eval --tasks")
    scores, n = benchmarks.task_scores(results, loaded_tasks.names), benchmarks.sample_count(results)
    summary = {"model": resolved["label"], "tasks": list(settings.tasks), "n": n, **benchmarks.flat_scores(scores),
               "headline": benchmarks.headline(scores, n)}
    record, records = benchmarks.results_record(results, settings, scores), benchmarks.sample_records(results)
    if resolved["run_dir"] is not None:
        from kitcli.display.eval_table import benchmark_file

        path = benchmark_file(resolved["run_dir"], resolved["name"])
        save_benchmarks(path, resolved, record, records)
        log(f"wrote {path} (the run's report shows it: kit report {resolved['run_dir']})")
    if output:
        out = Path(output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "benchmarks.json").write_text(json.dumps({**summary, "lm_eval": record}, indent=2, default=str))
        from kitcli.stages.eval import write_samples

        write_samples(out / "samples.jsonl", records)
        log(f"wrote {out / 'benchmarks.json'} and {out / 'samples.jsonl'}")
    return summary


def save_benchmarks(path: Path, resolved: dict[str, Any], record: dict[str, Any], records: list[dict]) -> None:
    """Merge into the model's file: the tasks scored now replace their earlier scores, other tasks stay."""
    from kitcli.models.benchmarks import flat_scores
    from kitcli.records import read_jsonl
    from kitcli.stages.eval import write_samples

    saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    tasks = {**(saved.get("tasks") or {}), **record}
    samples = path.with_name(f"{path.stem}-samples.jsonl")
    kept = [r for r in read_jsonl(samples) if r.get("task") not in record] if samples.is_file() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    n = sum(t.get("n") or 0 for t in tasks.values())
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps({"model": resolved["name"], "label": resolved["label"], "n": n,
                                   "scores": flat_scores({k: t["scores"] for k, t in tasks.items()}),
                                   "tasks": tasks}, indent=2, default=str), encoding="utf-8")
    staging.replace(path)
    write_samples(samples, kept + records)


def finish(summary: dict[str, Any], console, as_json: bool) -> None:
    print_scores(summary, console)
    if as_json:
        from kitcli.display.output import json_safe

        click.echo(json.dumps(json_safe(summary), default=str))


def print_scores(summary: dict[str, Any], console) -> None:
    from rich.table import Table

    from kitcli.display.eval_table import eval_metric_keys, format_score, metric_label

    scored = Path(summary["data"]).name if "data" in summary else ", ".join(summary["tasks"]) + " (lm-eval)"
    table = Table(title=f"{summary['model']} on {scored}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in eval_metric_keys([summary]):
        table.add_row(metric_label(key), format_score(summary[key]))
    table.add_row("prompts" if "data" in summary else "samples", str(summary["n"]))
    if "samples_per_prompt" in summary:
        table.add_row("samples per prompt", str(summary["samples_per_prompt"]))
    console.print(table)


@click.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False))
def report_command(run_dir: str) -> None:
    """Write RUN_DIR/report.md and RUN_DIR/plots/*.svg (curves of every stage, the eval table)."""
    from kitcli.display.report import write_report

    path = write_report(Path(run_dir))
    click.echo(f"report: {path}")
