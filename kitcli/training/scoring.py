"""Scoring generations on held-out rows: one implementation for an eval stage (kitcli/stages/eval.py), `kit eval`
and the held-out evaluation inside a training stage (kitcli/training/held_out.py).

`evaluate_rows` generates `n` completions per row (greedy by default, in batches) and scores them: exact match
against an `answer` column, pass@k for k = 1, 2, 4, ... n, and each reward's mean, the rewards called as GRPO calls
them (prompts, completions, completion_ids, the data's other columns) through the kit's guard. With `n` samples per
prompt, exact match is the mean over all samples and pass@k is the unbiased estimate 1 - C(n-c, k) / C(n, k)
averaged over prompts (c: correct samples of a prompt).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console

from kitcli.data.rows import require_columns
from kitcli.errors import KitError, did_you_mean
from kitcli.models.generate import exact_match, generate
from kitcli.recipe.schema import GenerationSpec

GENERATION_DEFAULTS = {name: field.default for name, field in GenerationSpec.model_fields.items()}


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
                  log, where: str, console: Console | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Generate `n` completions per row and score them. Returns (summary, one scored record per sample). With a
    terminal `console`, a progress bar counts the completions (quiet elsewhere, and without one)."""
    n = settings["n"]
    samples = [row for row in rows for _ in range(n)]
    prompts = [row["prompt"] for row in samples]
    with generation_progress(console, len(prompts)) as advance:
        texts = generate(model, tokenizer, prompts, max_new_tokens=settings["max_new_tokens"],
                         batch_size=settings["batch_size"], temperature=settings["temperature"], seed=seed,
                         on_batch=advance)
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


@contextlib.contextmanager
def generation_progress(console: Console | None, total: int) -> Iterator[Callable[[int], None] | None]:
    """rich's progress bar (count, rate, ETA) over `total` completions on a terminal; nothing elsewhere (CI, logs, a
    pipe, --json), and nothing without a console (an evaluation inside a training stage's live dashboard)."""
    if console is None or not console.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("generating", total=total)
        yield lambda done: progress.advance(task, done)


def format_score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def write_samples(path, records: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")

