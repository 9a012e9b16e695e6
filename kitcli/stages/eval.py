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
import math
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kitcli.data.rows import apply_system_prompt, read_rows, require_columns
from kitcli.errors import KitError, did_you_mean
from kitcli.models.backend import load_stage_policy
from kitcli.models.generate import exact_match, generate
from kitcli.recipe.schema import DataSpec, GenerationSpec, RewardSpec, StageSection, base_dir_of, fail
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import StageSpec
from kitcli.recipe.tool_spec import ToolSpec

GENERATION_DEFAULTS = {name: field.default for name, field in GenerationSpec.model_fields.items()}


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


BENCHMARK_KEYS = {"include_path": "it is where lm-eval finds local tasks", "num_fewshot": "lm-eval's setting",
                  "limit": "with data: use data.limit", "batch_size": "with data: use generation.batch_size",
                  "apply_chat_template": "a conversational prompt column always gets the chat template"}
DATA_KEYS = {"generation": "the task's YAML decides how lm-eval generates",
             "rewards": "lm-eval scores with the task's metrics", "system_prompt": "it is for data: rows",
             "tools": "tools run with data: rows", "max_tool_calling_iterations": "tools run with data: rows"}


def include_dirs(paths: list[str], base_dir, error=fail) -> tuple[str, ...]:
    """Task folders as absolute paths: relative to the recipe, the working directory or the kit checkout."""
    from pathlib import Path

    from kitcli.recipe.schema import kit_source_root

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


def check_generation(raw: Any, where: str) -> dict[str, Any]:
    settings = raw or {}
    if not isinstance(settings, dict):
        raise KitError(f"{where}: generation must be a mapping, e.g. {{max_new_tokens: 16, temperature: 0.0}}")
    unknown = set(settings) - set(GENERATION_DEFAULTS)
    if unknown:
        key = sorted(unknown)[0]
        raise KitError(f"{where}: unknown generation key '{key}'{did_you_mean(key, GENERATION_DEFAULTS)} "
                       f"(allowed: {', '.join(GENERATION_DEFAULTS)})")
    settings = {**GENERATION_DEFAULTS, **settings}
    for key in ("max_new_tokens", "batch_size", "n"):
        value = settings[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise KitError(f"{where}: generation.{key} must be a positive integer, got {value!r}")
    temperature = settings["temperature"]
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise KitError(f"{where}: generation.temperature must be a number >= 0 (0 is greedy), got {temperature!r}")
    if settings["n"] > 1 and temperature == 0:
        raise KitError(f"{where}: generation.n is {settings['n']} but temperature is 0, so every sample would be "
                       f"the same greedy completion; set generation.temperature (e.g. 0.8) or n: 1")
    return settings


def generation_settings(ctx: StageContext) -> dict[str, Any]:
    return check_generation(ctx.stage.get("generation"), ctx.where)


def load_eval_rewards(specs: Any, base_dir, where: str, run_dir=None):
    from rewards.registry import load_rewards

    return load_rewards(specs or [], base_dir, f"{where}: rewards", run_dir=run_dir)


def check_eval_rows(rows: list[dict[str, Any]], rewards, where: str, path: str) -> None:
    from rewards.registry import check_data

    require_columns(rows, [["prompt"]], where, path)
    if "answer" not in rows[0] and not rewards:
        raise KitError(f"{where}: nothing to score: '{path}' has no 'answer' column and the stage lists no "
                       f"rewards; add an answer column (map yours with columns: {{your_column: answer}}) or "
                       f"rewards: [...]")
    check_data(rewards, rows, where, f"'{path}'")


def load_rows(ctx: StageContext, rewards) -> list[dict[str, Any]]:
    spec = ctx.section.data
    rows = read_rows(spec, ctx.where)
    check_eval_rows(rows, rewards, ctx.where, spec.path)
    return apply_system_prompt(rows, ctx.section.system_prompt, ctx.where, spec.path)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with c of n samples correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    return sorted({1, n} | {2 ** i for i in range(1, n.bit_length()) if 2 ** i <= n})


def score_rewards(rewards, prompts, completions, completion_ids, rows) -> dict[str, list[float | None]]:
    """Each reward's scores for the samples, called as GRPOTrainer calls it (through the kit's guard)."""
    from rewards.guard import RewardStats, guard_rewards

    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    scores = {}
    for reward, fn in zip(rewards, guard_rewards(rewards, RewardStats())):
        scores[reward.name] = fn(prompts, completions, completion_ids=completion_ids, trainer_state=None, **columns)
    return scores


def mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def evaluate_rows(model, tokenizer, rows: list[dict[str, Any]], settings: dict[str, Any], rewards, *, seed: int,
                  log, where: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Generate `n` completions per row and score them. Returns (summary, one scored record per sample)."""
    n = settings["n"]
    samples = [row for row in rows for _ in range(n)]
    prompts = [row["prompt"] for row in samples]
    texts = generate(model, tokenizer, prompts, max_new_tokens=settings["max_new_tokens"],
                     batch_size=settings["batch_size"], temperature=settings["temperature"], seed=seed)
    conversational = isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts)
    completion_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    try:
        scores = score_rewards(rewards, prompts, completions, completion_ids, samples) if rewards else {}
    except KitError as error:
        raise KitError(f"{where}: {error.message}") from None
    weights = {r.name: r.weight for r in rewards}
    has_answer = "answer" in rows[0]
    records = []
    for index, (row, text) in enumerate(zip(samples, texts)):
        record = {"prompt": row["prompt"], "completion": text, "sample": index % n}
        if has_answer:
            record["answer"] = row["answer"]
            record["correct"] = exact_match(text, row["answer"])
        if scores:
            record["rewards"] = {name: values[index] for name, values in scores.items()}
            given = [weights[name] * v for name, v in record["rewards"].items() if v is not None]
            record["reward"] = sum(given) if given else None
        records.append(record)

    summary: dict[str, Any] = {"n": len(rows), "samples_per_prompt": n, "temperature": settings["temperature"]}
    parts = []
    if has_answer:
        correct = sum(r["correct"] for r in records)
        summary.update({"exact_match": correct / len(records), "correct": correct})
        parts.append(f"exact match {summary['exact_match']:.3f} ({correct}/{len(records)})")
        if n > 1:
            per_prompt = [sum(r["correct"] for r in records[i:i + n]) for i in range(0, len(records), n)]
            for k in ks_for(n):
                summary[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in per_prompt) / len(per_prompt)
            parts.append(f"pass@{n} {summary[f'pass@{n}']:.3f}")
    if scores:
        summary["reward"] = mean([r["reward"] for r in records])
        for name, values in scores.items():
            summary[f"rewards/{name}"] = mean(values)
            summary[f"rewards/{name}/scored"] = sum(v is not None for v in values)
        parts.append(f"reward {format_score(summary['reward'])}")
        if len(scores) > 1:
            parts.append(", ".join(f"{name} {format_score(summary[f'rewards/{name}'])}" for name in scores))
    summary["headline"] = "; ".join(parts)
    for record in records[: settings["show"] * n: n]:
        question = record["prompt"][-1]["content"] if isinstance(record["prompt"], list) else record["prompt"]
        mark = ("ok " if record["correct"] else "bad") if has_answer else f"{format_score(record.get('reward'))}"
        expected = f" (answer {record['answer']!r})" if has_answer else ""
        log(f"  [{mark}] {question!r} -> {record['completion'].strip()!r}{expected}")
    return summary, records


def format_score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def write_samples(path, records: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")


def benchmark_settings(ctx: StageContext):
    from kitcli.models.benchmarks import BenchmarkSettings, task_names

    section, paths = ctx.section, ctx.section.include_path
    return BenchmarkSettings(tasks=task_names(section.tasks, ctx.where),
                             include_path=include_dirs([paths] if isinstance(paths, str) else paths,
                                                       ctx.recipe.base_dir, lambda m: KitError(f"{ctx.where}: {m}")),
                             limit=section.limit, num_fewshot=section.num_fewshot, batch_size=section.batch_size,
                             apply_chat_template=section.apply_chat_template,
                             max_length=ctx.model["max_seq_length"])


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
    rewards = load_eval_rewards(ctx.stage.get("rewards"), ctx.recipe.base_dir, ctx.where, ctx.run_dir)
    rows = load_rows(ctx, rewards)
    return {"init": ctx.section.init or "base model", "data": ctx.section.data.path, "rows": len(rows),
            "rewards": [f"{r.name} (weight {r.weight:g}, {r.source})" for r in rewards],
            "exact_match": "answer" in rows[0], "generation": settings, **describe_tools(ctx)}


def run(ctx: StageContext) -> dict[str, Any]:
    if ctx.section.tasks is not None:
        return run_tasks(ctx)
    settings = generation_settings(ctx)
    rewards = load_eval_rewards(ctx.stage.get("rewards"), ctx.recipe.base_dir, ctx.where, ctx.run_dir)
    rows = load_rows(ctx, rewards)
    loaded = load_stage_policy(ctx.model, lora=None, seed=ctx.seed, init_from=ctx.init_dir, trainable=False,
                               log=ctx.log, label="evaluated model")
    summary, records = evaluate_rows(loaded.model, loaded.tokenizer, rows, settings, rewards, seed=ctx.seed,
                                     log=ctx.log, where=ctx.where)
    if ctx.section.tools:  # the same rows again, greedy, with the tools (kitcli/training/tool_use.py)
        from kitcli.training.tool_use import evaluate_with_tools

        summary.update(evaluate_with_tools(ctx, loaded.model, loaded.tokenizer, rows, records, settings))
        summary["headline"] += "; " + summary.pop("headline_tools")
    write_samples(ctx.dir.samples, records)
    ctx.log(f"{ctx.name}: {summary['headline']}")
    return summary


SPEC = StageSpec(
    type="eval", order=100, module=__name__, section=EvalSection,
    summary="greedy (or n-sample) generation on a held-out file: exact match, pass@k, reward means; or "
            "lm-evaluation-harness tasks",
    output="none", init_from=("policy",), evaluates=True, rows_shape="prompts",
    launcher="main process only (the others wait)")
