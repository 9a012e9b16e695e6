"""Eval stage: generate for held-out prompts and score them: exact match (and pass@k) against an `answer`
column, and the mean of each reward function listed under `rewards:`.

    kit run tiny-sft                  (eval-before -> sft -> eval-after)
    kit eval runs/tiny-sft/sft --data examples/data/arithmetic_eval.jsonl --reward exact_match

A recipe puts one before and one after its training stages (`init:` names the stage to evaluate; without it,
the base model); the run ends with a before/after table.

    - name: eval-after
      type: eval
      init: grpo
      data: examples/data/arithmetic_eval.jsonl      # prompt, and optionally answer and the rewards' columns
      rewards: [exact_match, {name: format, weight: 0.5}]
      generation: {max_new_tokens: 16, temperature: 0.0}      # greedy: one completion per prompt
      # generation: {n: 8, temperature: 0.8}                   # 8 samples per prompt: pass@1, 2, 4, 8

Or lm-evaluation-harness tasks instead of `data:` (kitcli/models/benchmarks.py, docs/benchmarks.md), scored by
lm-eval on the same model; the scores join the before/after table as `<task>: <metric>` rows:

    - name: bench-after
      type: eval
      init: sft
      tasks: [kit_arithmetic]                        # lm-eval names, or tasks of the include_path folders
      include_path: examples/benchmarks
      apply_chat_template: true
      limit: 20                                      # and num_fewshot, batch_size

Rewards are called as GRPO calls them (prompts, completions, completion_ids, the data's other columns), through
the same guard, so an eval reports the quantity an RL stage optimizes. `reward` is their weighted sum.
With `n` samples per prompt, exact match is the mean over all samples and pass@k is the unbiased estimate
1 - C(n-c, k) / C(n, k) averaged over prompts (c: correct samples of a prompt), for k = 1, 2, 4, ... n.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_serializer, model_validator

from kitcli.data.rows import apply_system_prompt, read_rows
from kitcli.errors import KitError
from kitcli.models.backend import load_stage_policy
from kitcli.recipe.schema import DataSpec, GenerationSpec, RewardSpec, StageSection, base_dir_of, fail
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Launcher, Rows, StageSpec
from kitcli.recipe.tool_spec import ToolSpec
from kitcli.training.scoring import (  # noqa: F401  (kit eval and the tests import the scoring from here too)
    GENERATION_DEFAULTS,
    check_eval_rows,
    check_generation,
    evaluate_rows,
    ks_for,
    load_eval_rewards,
    pass_at_k,
    write_samples,
)


class EvalSection(StageSection):
    """Held-out evaluation: generate for each prompt, score exact match, pass@k and rewards."""

    type: Literal["eval"]
    data: DataSpec | None = Field(None, description="Held-out rows: prompt, and answer for exact match (or tasks:).")
    tasks: list[str] | None = Field(None, description="lm-evaluation-harness tasks to score instead of data: "
                                                      "(docs/benchmarks.md).")
    include_path: list[str] = Field(default_factory=list, description="Folders of local lm-eval task YAML files.")
    num_fewshot: Annotated[int, Field(ge=0)] | None = Field(None, description="Few-shot examples (default: the "
                                                                              "task's own).")
    limit: Annotated[int, Field(gt=0)] | None = Field(None, description="Score only the first N documents of each "
                                                                        "task.")
    batch_size: Annotated[int, Field(gt=0)] = Field(32, description="Requests per lm-eval batch.")
    apply_chat_template: bool = Field(False, description="Format each task prompt with the model's chat template.")
    generation: GenerationSpec | None = Field(None, description="How to generate.")
    rewards: list[RewardSpec] = Field(default_factory=list, description="Rewards to average over the completions.")
    system_prompt: str | None = Field(None, description="A system message put before every prompt.")
    tools: list[ToolSpec] = Field(default_factory=list, description="Tools the model may call: a second, greedy run "
                                                                    "with them (docs/tools.md).")
    max_tool_calling_iterations: Annotated[int, Field(ge=0)] = Field(4, description="Rounds of tool calls per "
                                                                                    "problem in the run with tools.")

    @field_validator("generation", mode="before")
    @classmethod
    def mapping(cls, raw):
        if raw is not None and not isinstance(raw, dict):
            raise fail("generation must be a mapping, e.g. {max_new_tokens: 16, temperature: 0.0}")
        return raw

    @field_validator("tasks", mode="before")
    @classmethod
    def names(cls, raw):
        return [n.strip() for n in raw.split(",") if n.strip()] if isinstance(raw, str) else raw

    @field_validator("include_path", mode="before")
    @classmethod
    def one_folder(cls, raw):
        return [raw] if isinstance(raw, str) else raw

    @field_validator("include_path", mode="after")
    @classmethod
    def folders(cls, paths: list[str], info: ValidationInfo) -> list[str]:
        include_dirs(paths, base_dir_of(info))
        return paths

    @model_validator(mode="after")
    def data_or_tasks(self):
        if (self.data is None) == (self.tasks is None):
            raise fail("an eval stage scores a held-out file (data:) or lm-evaluation-harness tasks (tasks:); give "
                       f"{'one' if self.data is None else 'one of them, not both'}")
        if self.tasks is not None and not self.tasks:
            raise fail("tasks: is empty; name lm-eval tasks, e.g. tasks: [gsm8k]")
        only = BENCHMARK_KEYS if self.data is not None else DATA_KEYS
        given = sorted(self.model_fields_set & set(only))
        if given:
            kind = "data:" if self.data is not None else "tasks:"
            raise fail(f"{given[0]}: does not apply to an eval stage with {kind} ({only[given[0]]}); remove it")
        return self

    @model_serializer(mode="wrap")
    def applicable(self, handler):
        """The keys of its form only (data: or tasks:): the lock's dump reads back as this same section."""
        only = BENCHMARK_KEYS if self.data is not None else DATA_KEYS
        return {key: value for key, value in handler(self).items() if key not in only}


BENCHMARK_KEYS = {"include_path": "it is where lm-eval finds local tasks", "num_fewshot": "lm-eval's setting",
                  "limit": "with data: use data.limit", "batch_size": "with data: use generation.batch_size",
                  "apply_chat_template": "a conversational prompt column always gets the chat template"}
DATA_KEYS = {"generation": "the task's YAML decides how lm-eval generates",
             "rewards": "lm-eval scores with the task's metrics", "system_prompt": "it is for data: rows",
             "tools": "tools run with data: rows", "max_tool_calling_iterations": "tools run with data: rows"}


def include_dirs(paths: list[str], base_dir, error=fail) -> tuple[str, ...]:
    """Task folders as absolute paths: relative to the recipe, the working directory or the kit checkout."""
    from pathlib import Path

    from kitcli.recipe.paths import kit_source_root

    found = []
    for path in paths:
        given = Path(path).expanduser()
        candidates = [given] if given.is_absolute() else [Path(base_dir) / given, Path.cwd() / given,
                                                           kit_source_root() / given]
        folder = next((c for c in candidates if c.is_dir()), None)
        if folder is None:
            raise error(f"include_path '{path}' is not a folder (looked relative to {base_dir}, the working directory "
                       f"and the kit); give a folder of lm-eval task YAML files")
        found.append(str(folder.resolve()))
    return tuple(found)


def generation_settings(ctx: StageContext) -> dict[str, Any]:
    given = ctx.stage.generation
    return check_generation(given.model_dump() if given is not None else None, ctx.where)


def load_rows(ctx: StageContext, rewards) -> list[dict[str, Any]]:
    spec = ctx.section.data
    rows = read_rows(spec, ctx.where)
    check_eval_rows(rows, rewards, ctx.where, spec.path)
    return apply_system_prompt(rows, ctx.section.system_prompt, ctx.where, spec.path)

def benchmark_settings(ctx: StageContext):
    from kitcli.models.benchmarks import BenchmarkSettings, task_names

    section, paths = ctx.section, ctx.section.include_path
    return BenchmarkSettings(tasks=task_names(section.tasks, ctx.where),
                             include_path=include_dirs([paths] if isinstance(paths, str) else paths,
                                                       ctx.recipe.base_dir, lambda m: KitError(f"{ctx.where}: {m}")),
                             limit=section.limit, num_fewshot=section.num_fewshot, batch_size=section.batch_size,
                             apply_chat_template=section.apply_chat_template,
                             max_length=ctx.model.max_seq_length)


def run_tasks(ctx: StageContext) -> dict[str, Any]:
    """`tasks:`: lm-eval scores the stage's model; the scores go to DONE, lm-eval's per-task record to
    benchmarks.json, one line per scored document to samples.jsonl."""
    from kitcli.models import benchmarks

    settings = benchmark_settings(ctx)
    tasks = benchmarks.load_tasks(settings, ctx.where)
    loaded = load_stage_policy(ctx.model, lora=None, seed=ctx.seed, init_from=ctx.init_dir, trainable=False,
                               log=ctx.log, label="evaluated model")
    results = benchmarks.run_benchmarks(loaded.model, loaded.tokenizer, tasks, settings, console=ctx.console,
                                        where=ctx.where)
    scores, n = benchmarks.task_scores(results, tasks.names), benchmarks.sample_count(results)
    write_samples(ctx.dir.samples, benchmarks.sample_records(results))
    (ctx.stage_dir / "benchmarks.json").write_text(json.dumps(benchmarks.results_record(results, settings, scores),
                                                              indent=2, default=str), encoding="utf-8")
    summary = {"n": n, "tasks": list(settings.tasks), **benchmarks.flat_scores(scores),
               "headline": benchmarks.headline(scores, n)}
    ctx.log(f"{ctx.name}: {summary['headline']}")
    return summary


def describe(ctx: StageContext) -> dict[str, Any]:
    from kitcli.training.tool_use import describe_tools

    if ctx.section.tasks is not None:  # names checked and datasets loaded now, before anything trains
        from kitcli.models.benchmarks import load_tasks

        settings = benchmark_settings(ctx)
        load_tasks(settings, ctx.where)
        return {"init": ctx.section.init or "base model", "lm_eval": settings.record()}
    settings = generation_settings(ctx)
    rewards = load_eval_rewards(ctx.stage.rewards, ctx.recipe.base_dir, ctx.where, ctx.run_dir)
    rows = load_rows(ctx, rewards)
    return {"init": ctx.section.init or "base model", "data": ctx.section.data.path, "rows": len(rows),
            "rewards": [f"{r.name} (weight {r.weight:g}, {r.source})" for r in rewards],
            "exact_match": "answer" in rows[0], "generation": settings,
            **describe_tools(ctx.stage, ctx.model, ctx.recipe.base_dir, ctx.where)}


def run(ctx: StageContext) -> dict[str, Any]:
    if ctx.section.tasks is not None:
        return run_tasks(ctx)
    settings = generation_settings(ctx)
    rewards = load_eval_rewards(ctx.stage.rewards, ctx.recipe.base_dir, ctx.where, ctx.run_dir)
    rows = load_rows(ctx, rewards)
    loaded = load_stage_policy(ctx.model, lora=None, seed=ctx.seed, init_from=ctx.init_dir, trainable=False,
                               log=ctx.log, label="evaluated model")
    summary, records = evaluate_rows(loaded.model, loaded.tokenizer, rows, settings, rewards, seed=ctx.seed,
                                     log=ctx.log, where=ctx.where, console=ctx.console)
    if ctx.section.tools:  # the same rows again, greedy, with the tools (kitcli/training/tool_use.py)
        from kitcli.training.tool_use import evaluate_with_tools

        summary.update(evaluate_with_tools(ctx.stage, loaded.model, loaded.tokenizer, rows, records, settings,
                                           model_name=ctx.model.name, base_dir=ctx.recipe.base_dir, where=ctx.where))
        summary["headline"] += "; " + summary.pop("headline_tools")
    write_samples(ctx.dir.samples, records)
    ctx.log(f"{ctx.name}: {summary['headline']}")
    return summary


SPEC = StageSpec(
    type="eval", order=100, module=__name__, section=EvalSection,
    summary="greedy (or n-sample) generation on a held-out file: exact match, pass@k, reward means; or "
            "lm-evaluation-harness tasks",
    output="none", init_from=("policy",), evaluates=True, rows=Rows(shape="prompts"),
    launcher=Launcher("main process only (the others wait)"))
