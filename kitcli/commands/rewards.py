"""`kit rewards`: list the rewards that can be named in a recipe, score a file of completions with one, and
preview a stage's rewards on completions sampled from its starting model, all before any GPU time is spent.

    kit rewards list
    kit rewards test exact_match --data examples/my_rewards_samples.jsonl
    kit rewards test examples/my_rewards.py:ends_with_answer --data examples/my_rewards_samples.jsonl
    kit rewards preview tiny-grpo --stage grpo -n 16
    kit rewards sandbox

Imports nothing heavy at module level (`kit --help` stays fast); `preview` loads the model inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kitcli.errors import KitError


def console():
    from rich.console import Console

    return Console(highlight=False)


def parse_args(items: tuple[str, ...]) -> dict[str, Any]:
    """`--arg tags=[think,answer] --arg strict=true` -> {"tags": ["think", "answer"], "strict": True} (YAML values)."""
    import yaml

    args = {}
    for item in items:
        if "=" not in item:
            raise KitError(f"--arg '{item}': expected KEY=VALUE, e.g. --arg tags=[think,answer]")
        key, text = item.split("=", 1)
        try:
            args[key.strip()] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            raise KitError(f"--arg '{item}': the value is not valid YAML; quote it, e.g. --arg 'x=\"a: b\"'") from None
    return args


def short(text: Any, limit: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def message_text(value: Any) -> str:
    from rewards.text import completion_text, prompt_text

    if isinstance(value, list) and value and isinstance(value[0], dict) and value[0].get("role") == "assistant":
        return completion_text(value)
    return prompt_text(value) if isinstance(value, list) else str(value)


@click.group()
def rewards() -> None:
    """List, test and preview reward functions."""


@rewards.command("list")
def rewards_list() -> None:
    """List the rewards a recipe can name.

    Name, where it comes from (built-in or the package that registers it), the args a factory takes, and
    what it does."""
    from rich.table import Column, Table

    from rewards.registry import ENTRY_POINT_GROUP, reward_catalog

    table = Table(Column("name", no_wrap=True), "args", "from", "what it does")
    for row in reward_catalog():
        table.add_row(row["name"], row["args"], row["source"], row["doc"])
    out = console()
    out.print(table)
    out.print(f"Also: module:function, or path/to/file.py:function (relative to the recipe). Packages add rewards "
              f"through the '{ENTRY_POINT_GROUP}' entry-point group.", markup=False)


@rewards.command("test")
@click.argument("reward")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="JSONL (or JSON/CSV/Parquet) with a `completion` column, optional `prompt`, and the columns the "
                   "reward reads (e.g. answer).")
@click.option("--arg", "arg_items", multiple=True, metavar="KEY=VALUE",
              help="An argument for a reward factory, as in the recipe's args: (repeatable), e.g. --arg tags=[answer].")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory, for rewards that read one "
                                                                   "(reward_model stage:).")
@click.option("--show", default=20, show_default=True, help="Rows to print in the table.")
def rewards_test(reward: str, data_path: str, arg_items: tuple[str, ...], run_dir: str | None, show: int) -> None:
    """Score a file of completions with one reward.

    REWARD is a name (see `kit rewards list`), module:function or path/to/file.py:function. Prints each row's
    score and the distribution."""
    from rich.table import Table

    from kitcli.data.rows import read_rows
    from rewards.guard import format_range
    from rewards.registry import check_data, load_reward, required_columns
    from rewards.sample_scores import format_number, score_sample

    where = "kit rewards test"
    path = Path(data_path)
    if not path.is_file():
        raise KitError(f"{where}: --data '{data_path}' does not exist; give a JSONL file with a completion column")
    rows = read_rows({"path": str(path)}, f"{where}: {path}")
    if "completion" not in rows[0]:
        raise KitError(f"{where}: '{path}' needs a 'completion' column (a string, or a list of messages); it has "
                       f"{', '.join(sorted(rows[0]))}")
    loaded = load_reward({"name": reward, "args": parse_args(arg_items)}, Path.cwd(), where,
                         run_dir=Path(run_dir) if run_dir else None)
    check_data([loaded], rows, where, f"'{path}'", mapping_hint=False)
    prompts = [row.get("prompt", "") for row in rows]
    completions = [row["completion"] for row in rows]
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    try:
        report = score_sample(loaded, prompts, completions, columns, keep_going=False)
    except KitError as error:
        mismatch = shape_mismatch(error, loaded.name, completions, where, path)
        if mismatch is None:
            raise
        raise KitError(mismatch) from None

    out = console()
    shown = [c for c in required_columns(loaded.fn) if c in rows[0]]
    table = Table("#", "completion", *shown, loaded.name, title=f"{loaded.name} ({loaded.source})")
    outside = dict(report.violations)
    for index, (row, score) in enumerate(zip(rows[:show], report.scores)):
        table.add_row(str(index), short(message_text(row["completion"])), *[short(row[c], 24) for c in shown],
                      format_number(score) + (" (outside!)" if index in outside else ""),
                      style="red" if index in outside else None)
    out.print(table)
    out.print(f"{loaded.name}: " + (f"scores in {format_range(loaded.score_range)} (its declared range)"
                                    if loaded.score_range else "no declared range"), markup=False)
    if len(rows) > show:
        out.print(f"... {len(rows) - show} more rows (--show N)", markup=False)
    print_distribution(out, report)
    if "completion_ids" not in rows[0] and any(n in loaded.name for n in ("length", "overlong")):
        out.print("note: no completion_ids column, so lengths are counted in characters, not tokens", markup=False)
    for warning in report.warnings():
        out.print(f"warning: {warning}", style="yellow", markup=False)
    if outside:
        rows_at = ", ".join(str(i) for i in list(outside)[:10]) + (" ..." if len(outside) > 10 else "")
        raise KitError(f"{where}: reward '{loaded.name}' scored outside its declared range "
                       f"{format_range(loaded.score_range)} on rows {rows_at}; fix the function or its score_range")


def shape_mismatch(error: KitError, name: str, completions: list[Any], where: str, path: Path) -> str | None:
    """When a reward failed because it reads completions in the other format (a notebook's `completion[0]["content"]`
    on plain strings, or `.strip()` / `re.search` on lists of messages), the line that says so and how to convert;
    else None. Told by the samples' shape and the exception the guard caught (its KitError's context), not by reading
    the reward's source."""
    raised = error.__context__
    if not isinstance(raised, (TypeError, AttributeError)):
        return None
    text = str(raised)
    said = f"reward '{name}' raised {type(raised).__name__}: {text}"
    if all(isinstance(c, str) for c in completions) and (
            "string indices" in text or "'str' object has no attribute" in text):
        return (f"{where}: {said}: it reads each completion as a list of messages, but the completions in '{path}' "
                f"are plain strings; write them as messages, e.g. {{\"completion\": [{{\"role\": \"assistant\", "
                f"\"content\": \"...\"}}]}} (in a run, rewards get messages when the stage's prompts are message "
                f"lists, e.g. data: {{chat: true}})")
    if all(isinstance(c, list) for c in completions) and (
            "'list' object has no attribute" in text or (isinstance(raised, TypeError) and "list" in text)):
        return (f"{where}: {said}: it reads each completion as a string, but the completions in '{path}' are lists "
                f"of messages; write them as strings, e.g. {{\"completion\": \"...\"}}, or read the text in the "
                f"reward as completion[-1][\"content\"] (in a run, rewards get strings when the stage's prompts are "
                f"strings)")
    return None


def print_distribution(out, report) -> None:
    from rewards.sample_scores import format_number, histogram

    summary = report.summary()
    if summary.get("scored"):
        out.print(f"{report.name}: {summary['scored']}/{summary['n']} scored, mean {format_number(summary['mean'])}, "
                  f"std {format_number(summary['std'])}, min {format_number(summary['min'])}, max "
                  f"{format_number(summary['max'])}, zero {summary['zero']:.0%}, {report.seconds * 1000:.1f} ms",
                  markup=False)
        for label, count, bar in histogram(report.values):
            out.print(f"  {label:>18} {count:5d} {bar}", markup=False)
    else:
        out.print(f"{report.name}: no scores", markup=False)


@rewards.command("preview")
@click.argument("recipe")
@click.option("--stage", "stage_name", help="The stage whose rewards to preview (default: the first with rewards).")
@click.option("-n", "count", default=16, show_default=True, help="Completions to sample (one per prompt).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory holding the init stage's output (default: the newest run of this recipe).")
@click.option("--max-new-tokens", type=int, help="Completion length (default: the stage's max_completion_length).")
@click.option("--temperature", type=float, help="Sampling temperature (default: the stage's temperature).")
@click.option("--show", default=3, show_default=True, help="Samples to print with their scores.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe value (repeatable).")
def rewards_preview(recipe: str, stage_name: str | None, count: int, run_dir: str | None,
                    max_new_tokens: int | None, temperature: float | None, show: int,
                    overrides: tuple[str, ...]) -> None:
    """Preview a stage's rewards on completions from its starting model.

    Samples N completions (one per prompt) from the stage's starting model on the stage's data, scores them with
    every reward of the stage, and warns about rewards that are constant over the sample or fail."""
    from kitcli.commands.rewards_preview import preview

    if count < 1:
        raise KitError("-n must be at least 1")
    preview(recipe, stage_name=stage_name, count=count, run_dir=Path(run_dir) if run_dir else None,
            max_new_tokens=max_new_tokens, temperature=temperature, show=show, overrides=list(overrides),
            console=console())


@rewards.command("sandbox")
def rewards_sandbox() -> None:
    """Show which code-sandbox limits hold on this machine."""
    from rich.table import Table

    from rewards.isolation import isolation

    table = Table("limit", "held by")
    for name, how in isolation().layers.items():
        table.add_row(name, how)
    console().print(table)
