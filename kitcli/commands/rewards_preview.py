"""`kit rewards preview RECIPE`: sample completions from a stage's starting model on the stage's data, score them
with every reward of the stage, and warn about rewards that give no signal, before a run spends GPU time.

The starting model is the base model, or the `init` stage's output when the run directory holds it
(`--run-dir`, else the newest `runs/<recipe name>-*` of the same recipe).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kitcli.errors import KitError, did_you_mean
from kitcli.recipe.schema import declared
from kitcli.rundir import StageDir

FALLBACK_GENERATION = {"max_completion_length": 64, "temperature": 1.0}


def scored(stage) -> bool:
    """Whether a stage (its typed section) lists rewards or a reward model."""
    return bool(declared(stage, "rewards")) or declared(stage, "reward_model") is not None


def choose_stage(recipe, stage_name: str | None):
    names = [s.name for s in recipe.stages]
    if stage_name is not None:
        if stage_name not in names:
            raise KitError(f"{recipe.source}: no stage named '{stage_name}'{did_you_mean(stage_name, names)} "
                           f"(stages: {', '.join(names)})")
        stage = recipe.stage(stage_name)
        if not scored(stage):
            with_rewards = [s.name for s in recipe.stages if scored(s)]
            raise KitError(f"{recipe.source}: stage '{stage_name}' has no rewards; stages with rewards: "
                           f"{', '.join(with_rewards) or 'none'}")
        return stage
    for stage in recipe.stages:
        if scored(stage):
            return stage
    raise KitError(f"{recipe.source}: no stage lists rewards; add rewards: to a grpo, gspo or ppo stage")


def find_run_dir(recipe, run_dir: Path | None) -> Path | None:
    if run_dir is not None:
        if not run_dir.is_dir():
            raise KitError(f"--run-dir '{run_dir}' is not a directory")
        return run_dir
    from kitcli.run.lock import choose_run_dir

    candidate = choose_run_dir(recipe, None)
    return candidate if candidate.is_dir() else None


def stage_context(recipe, stage, run_dir: Path | None, console):
    from kitcli.recipe.stage_context import StageContext

    base = run_dir or Path("runs") / f"{recipe.name}-PREVIEW"
    outputs = {s.name: base / s.name for s in recipe.stages}
    return StageContext(recipe, stage, base, console, outputs)


def stage_rows(ctx, stage) -> list[dict[str, Any]]:
    """The rows as the stage sees them (its spec's `rows`, e.g. with a system prompt), else as read."""
    from kitcli.data.rows import read_rows, require_columns

    reader = stage.spec.rows.read
    if reader is not None:
        return reader(ctx)
    rows = read_rows(stage.data, ctx.where)
    require_columns(rows, [["prompt"]], ctx.where, stage.data.path)
    return rows


def generation_settings(ctx, stage) -> dict[str, Any]:
    """max_completion_length and temperature: the recipe's train: values, else the stage type's defaults."""
    defaults = dict(FALLBACK_GENERATION)
    make_defaults = stage.spec.defaults
    if make_defaults is not None:
        found = make_defaults(ctx)
        found.setdefault("max_completion_length", found.get("response_length"))  # PPO's name for it
        defaults.update({k: found[k] for k in defaults if found.get(k) is not None})
    train = dict(declared(stage, "train") or {})
    train.setdefault("max_completion_length", train.get("response_length"))
    return {k: train[k] if train.get(k) is not None else v for k, v in defaults.items()}


def stage_rewards(ctx, stage, run_dir: Path | None):
    """The stage's `rewards:` plus its `reward_model:` as a reward_model reward, with their weights."""
    from rewards.registry import LoadedReward, load_reward, load_rewards

    loaded = load_rewards(declared(stage, "rewards") or [], ctx.recipe.base_dir, f"{ctx.where}: rewards",
                          run_dir=run_dir)
    spec = declared(stage, "reward_model")
    if spec is not None:
        args = {"stage": spec.stage} if spec.stage else {"path": spec.path}
        model_reward = load_reward({"name": "reward_model", "args": args, "weight": spec.weight},
                                   ctx.recipe.base_dir, f"{ctx.where}: reward_model",
                                   run_dir=run_dir or ctx.run_dir)
        source = f"reward stage '{spec.stage}'" if spec.stage else spec.path
        loaded.append(LoadedReward(fn=model_reward.fn, name=model_reward.name, weight=model_reward.weight,
                                   source=source))
    return loaded


def preview(recipe_name: str, *, stage_name: str | None, count: int, run_dir: Path | None,
            max_new_tokens: int | None, temperature: float | None, show: int, overrides: list[str], console) -> None:
    from rich.table import Table

    from kitcli.recipe.load import load_recipe
    from rewards.registry import check_data
    from rewards.sample_scores import format_number, histogram, score_sample, weighted_total
    from rewards.text import completion_text, prompt_text

    recipe = load_recipe(recipe_name, overrides)
    stage = choose_stage(recipe, stage_name)
    run_dir = find_run_dir(recipe, run_dir)
    ctx = stage_context(recipe, stage, run_dir, console)
    rows = stage_rows(ctx, stage)
    rewards = stage_rewards(ctx, stage, run_dir)
    check_data(rewards, rows, ctx.where, f"'{stage.data.path}'")
    settings = generation_settings(ctx, stage)
    max_new_tokens = max_new_tokens or settings["max_completion_length"]
    temperature = settings["temperature"] if temperature is None else temperature

    picked = random.Random(recipe.seed).sample(rows, min(count, len(rows)))
    init_from = starting_point(stage, run_dir, console)
    from kitcli.models.backend import load_stage_policy
    from kitcli.models.generate import generate

    loaded = load_stage_policy(recipe.model, lora=None, seed=recipe.seed, init_from=init_from, trainable=False,
                               log=lambda m: console.print(m, markup=False), label="starting model")
    prompts = [row["prompt"] for row in picked]
    console.print(f"sampling {len(prompts)} completions (max_new_tokens {max_new_tokens}, temperature "
                  f"{temperature:g}) for stage '{stage.name}'", markup=False)
    texts = generate(loaded.model, loaded.tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                     seed=recipe.seed)
    completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
    columns = {key: [row.get(key) for row in picked] for key in picked[0] if key != "prompt"}
    columns["completion_ids"] = loaded.tokenizer(texts, add_special_tokens=False)["input_ids"]
    reports = [score_sample(reward, prompts, completions, columns) for reward in rewards]

    table = Table("reward", "weight", "mean", "std", "min", "max", "zero", "scored", "ms",
                  title="rewards over the sample")
    for report in reports:
        s = report.summary()
        cells = [format_number(s.get(k)) for k in ("mean", "std", "min", "max")]
        zero = f"{s['zero']:.0%}" if "zero" in s else "-"
        table.add_row(report.name, format_number(report.reward.weight), *cells, zero, f"{s['scored']}/{s['n']}",
                      f"{report.seconds * 1000:.1f}")
    totals = [t for t in weighted_total(reports) if t is not None]
    if totals and len(reports) > 1:
        mean = sum(totals) / len(totals)
        table.add_row("weighted total", "", format_number(mean), "", format_number(min(totals)),
                      format_number(max(totals)), "", f"{len(totals)}/{len(prompts)}", "")
    console.print(table)
    for report in reports:
        if report.values:
            console.print(f"{report.name}:", markup=False)
            for label, number, bar in histogram(report.values):
                console.print(f"  {label:>18} {number:5d} {bar}", markup=False)
    for index in range(min(show, len(prompts))):
        scores = ", ".join(f"{r.name} {format_number(r.scores[index])}" for r in reports)
        console.print(f"\nsample {index}: {prompt_text(prompts[index])!r}", markup=False)
        console.print(f"  -> {completion_text(completions[index])!r}", markup=False)
        console.print(f"  {scores}", markup=False)
    warnings = [w for report in reports for w in report.warnings()]
    for warning in warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)
    if not warnings:
        console.print("every reward varies over the sample", markup=False)


def starting_point(stage, run_dir: Path | None, console) -> Path | None:
    init = stage.init
    if init is None:
        console.print("starting model: the base model (the stage has no init)", markup=False)
        return None
    if run_dir is not None and StageDir(run_dir / init).saved_model() is not None:
        console.print(f"starting model: the output of stage '{init}' in {run_dir}", markup=False)
        return run_dir / init
    where = f"in {run_dir}" if run_dir else "(no run directory of this recipe yet)"
    console.print(f"note: init stage '{init}' has no output {where}; sampling from the base model instead "
                  f"(run the recipe up to '{init}' first, or pass --run-dir)", markup=False)
    return None
