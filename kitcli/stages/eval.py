"""Eval stage: generate for held-out prompts and score exact match against the `answer` column.

A recipe puts one before and one after its training stages (`init:` names the stage to evaluate; without it,
the base model); the run ends with a before/after table.
"""

from __future__ import annotations

import json
from typing import Any

from kitcli.backend import load_policy
from kitcli.data import read_rows, require_columns
from kitcli.errors import KitError
from kitcli.evaluate import exact_match, generate
from kitcli.runner import StageContext

GENERATION_DEFAULTS = {"max_new_tokens": 32, "batch_size": 32, "temperature": 0.0, "show": 3}


def generation_settings(ctx: StageContext) -> dict[str, Any]:
    settings = ctx.stage.get("generation") or {}
    unknown = set(settings) - set(GENERATION_DEFAULTS)
    if unknown:
        from kitcli.errors import did_you_mean

        key = sorted(unknown)[0]
        raise KitError(f"{ctx.where}: unknown generation key '{key}'{did_you_mean(key, GENERATION_DEFAULTS)} "
                       f"(allowed: {', '.join(GENERATION_DEFAULTS)})")
    return {**GENERATION_DEFAULTS, **settings}


def load_rows(ctx: StageContext) -> list[dict[str, Any]]:
    spec = ctx.stage["data"]
    rows = read_rows(spec, ctx.where)
    require_columns(rows, [["prompt", "answer"]], ctx.where, spec["path"])
    return rows


def describe(ctx: StageContext) -> dict[str, Any]:
    rows = load_rows(ctx)
    return {"init": ctx.stage.get("init") or "base model", "data": ctx.stage["data"]["path"], "rows": len(rows),
            "generation": generation_settings(ctx)}


def run(ctx: StageContext) -> dict[str, Any]:
    rows = load_rows(ctx)
    settings = generation_settings(ctx)
    loaded = load_policy(
        ctx.model["name"], max_seq_length=ctx.model["max_seq_length"], load_in_4bit=ctx.model["load_in_4bit"],
        lora=None, backend=ctx.model["backend"], dtype=ctx.model["dtype"], seed=ctx.seed, init_from=ctx.init_dir,
        trust_remote_code=ctx.model["trust_remote_code"], trainable=False, log=ctx.log, label="evaluated model",
    )
    completions = generate(loaded.model, loaded.tokenizer, [r["prompt"] for r in rows],
                           max_new_tokens=settings["max_new_tokens"], batch_size=settings["batch_size"],
                           temperature=settings["temperature"], seed=ctx.seed)
    scored = [{"prompt": r["prompt"], "completion": c, "answer": r["answer"], "correct": exact_match(c, r["answer"])}
              for r, c in zip(rows, completions)]
    with open(ctx.stage_dir / "samples.jsonl", "w", encoding="utf-8") as f:
        for row in scored:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    correct = sum(row["correct"] for row in scored)
    for row in scored[: settings["show"]]:
        question = row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else row["prompt"]
        mark = "ok " if row["correct"] else "bad"
        ctx.log(f"  [{mark}] {question!r} -> {row['completion'].strip()!r} (answer {row['answer']!r})")
    score = correct / len(scored)
    ctx.log(f"{ctx.name}: exact match {score:.3f} ({correct}/{len(scored)})")
    return {"exact_match": score, "correct": correct, "n": len(scored),
            "headline": f"exact match {score:.3f} ({correct}/{len(scored)})"}
