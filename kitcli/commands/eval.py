"""`kit eval` (score a model on a held-out file) and `kit report` (write a run's report.md and plots).

    kit eval runs/tiny-sft-20261202-120000/sft --data examples/data/arithmetic_eval.jsonl
    kit eval runs/tiny-grpo-20261202-130000 --data examples/data/arithmetic_eval.jsonl --reward exact_match \\
        --reward '{name: format, args: {tags: [answer]}}' --n 8 --temperature 0.8
    kit eval tiny --data examples/data/arithmetic_eval.jsonl
    kit report runs/tiny-sft-20261202-120000

The target is a run directory (its last training stage), a stage directory inside one (that stage's adapter on
the run's base model, as recipe.lock.yaml names it), or a model: a hub name, a local directory, or `tiny`.
Heavy libraries load only when a command runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from kitcli.errors import KitError
from kitcli.recipe.stage_types import is_policy, spec_output
from kitcli.rundir import RunDir, StageDir, read_run_lock


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
@click.option("--data", required=True, help="Held-out file (JSONL/JSON/CSV/Parquet) with a prompt column, and an "
                                            "answer column for exact match.")
@click.option("--reward", "rewards", multiple=True, metavar="NAME",
              help="A reward to average (repeatable): a name (`kit rewards list`), module:function, "
                   "file.py:function, or a YAML mapping '{name: format, args: {...}, weight: 0.5}'.")
@click.option("--n", "n", type=int, default=1, show_default=True, help="Samples per prompt (pass@k for k <= n).")
@click.option("--temperature", type=float, default=None,
              help="Sampling temperature (default 0, greedy; 1.0 when --n > 1).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--limit", type=int, default=None, help="Use only the first N rows.")
@click.option("--seed", type=int, default=None, help="Sampling seed (default: the run's seed, else 42).")
@click.option("--show", type=int, default=3, show_default=True, help="Print this many scored samples.")
@click.option("--max-seq-length", type=int, default=None, help="For a model name (default 1024).")
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None,
              help="Write eval.json (the scores) and samples.jsonl (every completion) to this directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the scores as one JSON object on stdout.")
def eval_command(target: str, data: str, rewards: tuple[str, ...], n: int, temperature: float | None,
                 max_new_tokens: int, batch_size: int, limit: int | None, seed: int | None, show: int,
                 max_seq_length: int | None, output: str | None, as_json: bool) -> None:
    """Score a model on a held-out file: TARGET is RUN_DIR[/STAGE] or a MODEL (hub name, directory, 'tiny')."""
    from rich.console import Console

    from kitcli.recipe.load import validate_data_spec
    from kitcli.stages.eval import check_eval_rows, check_generation, load_eval_rewards

    console = Console(highlight=False, stderr=as_json)
    resolved = resolve_target(target)
    settings = check_generation({"n": n, "temperature": temperature if temperature is not None else
                                 (1.0 if n > 1 else 0.0), "max_new_tokens": max_new_tokens,
                                 "batch_size": batch_size, "show": show}, "kit eval")
    if limit is not None and limit <= 0:
        raise KitError(f"--limit must be a positive integer, got {limit}")
    spec = validate_data_spec({"path": data, "limit": limit}, "--data", Path.cwd())
    from kitcli.data.rows import read_rows

    rows = read_rows(spec, "--data")
    specs = [parse_reward(r) for r in rewards]
    loaded_rewards = load_eval_rewards(specs, Path.cwd(), "--reward", resolved["run_dir"])
    check_eval_rows(rows, loaded_rewards, "kit eval", spec["path"])

    import contextlib

    from kitcli.models.backend import load_policy
    from kitcli.stages.eval import evaluate_rows, write_samples

    def log(message: str) -> None:
        console.print(message, highlight=False, markup=False, soft_wrap=True)

    model = resolved["model"]
    run_seed = seed if seed is not None else resolved["seed"]
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        loaded = load_policy(model["name"], max_seq_length=max_seq_length or model["max_seq_length"],
                             load_in_4bit=model["load_in_4bit"], lora=None, backend=model["backend"],
                             dtype=model["dtype"], seed=run_seed, init_from=resolved["init_dir"],
                             trust_remote_code=model["trust_remote_code"], trainable=False, log=log,
                             label="evaluated model")
        summary, records = evaluate_rows(loaded.model, loaded.tokenizer, rows, settings, loaded_rewards,
                                         seed=run_seed, log=log, where="kit eval")
    summary = {"model": resolved["label"], "data": spec["path"], **summary}
    if output:
        out = Path(output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(summary, indent=2, default=str))
        write_samples(StageDir(out).samples, records)
        log(f"wrote {out / 'eval.json'} and {out / 'samples.jsonl'}")
    print_scores(summary, console)
    if as_json:
        from kitcli.display.dashboard import json_safe

        click.echo(json.dumps(json_safe(summary), default=str))


def print_scores(summary: dict[str, Any], console) -> None:
    from rich.table import Table

    from kitcli.display.report import eval_metric_keys, format_score, metric_label

    table = Table(title=f"{summary['model']} on {Path(summary['data']).name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in eval_metric_keys([summary]):
        table.add_row(metric_label(key), format_score(summary[key]))
    table.add_row("prompts", str(summary["n"]))
    table.add_row("samples per prompt", str(summary["samples_per_prompt"]))
    console.print(table)


@click.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False))
def report_command(run_dir: str) -> None:
    """Write RUN_DIR/report.md and RUN_DIR/plots/*.svg (curves of every stage, the eval table)."""
    from kitcli.display.report import write_report

    path = write_report(Path(run_dir))
    click.echo(f"report: {path}")
