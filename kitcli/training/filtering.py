"""Difficulty filtering: an RL stage trains only on the prompts its starting policy sometimes solves.

    filter: {k: 8, min_pass: 0.1, max_pass: 0.9}       # in a grpo / gspo / rloo stage (kitcli/recipe/filter_spec.py)
    kit data filter smol-grpo grpo -o kept.jsonl       # the same, written to a file

Before training, the stage samples k completions of every prompt from the policy it starts from (the model it has
just loaded, with the earlier stage's adapter), at the stage's own sampling settings (temperature, top_p, top_k,
min_p, repetition_penalty, max_completion_length; in a stage with `tools:` each completion is a conversation with
the tools live, as the trainer samples it: kitcli/models/tool_loop.py), scores them with its rewards
(kitcli/training/signal.py says what passes) and keeps the prompts whose pass rate lies in [min_pass, max_pass]: a
prompt solved every time or never gives a group with equal rewards, hence zero advantage (DAPO's dynamic sampling
drops such groups during training; this drops them before, once). The pass rates are cached in
`<stage>/filter/<key>.jsonl`, one line per prompt, written batch by batch: the key hashes the starting policy (its
adapter's bytes, or the base model's name and file), the data (file hash, columns, limit, chat, system prompt), the
rewards, the seed, k, the sampling settings and the tools with their rounds of calls, so an interrupted stage
resumes where it stopped and a changed bound reuses every rate. The kept share and the pass-rate histograms go to
the stage's DONE (`filter`) and the report. A filter that keeps no prompt, or fewer than one generation batch draws,
stops the stage before training with the histogram and the bound at fault.

TRL's own knob during training: none in TRL 1.15 for GRPO (it logs frac_reward_zero_std); a DAPO-style resample is
not offered, and `loss_type: dapo` only masks truncated completions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kitcli.cache import file_sha256
from kitcli.errors import KitError
from kitcli.recipe.filter_spec import FilteredSection, FilterSpec  # FilteredSection: the stages' section too
from kitcli.recipe.schema import declared
from kitcli.rundir import StageDir, write_atomic
from kitcli.training.signal import Group, histogram, pass_rule, score_groups, summarize

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SUMMARY_NAME = "summary.json"


def filter_dir(stage_dir: Path) -> Path:
    return StageDir(Path(stage_dir)).filter


def sampling_settings(values: Any) -> tuple[dict[str, Any], int]:
    """generate()'s sampling keywords and max_new_tokens from a resolved config (a TRL config or a dict)."""
    get = values.get if isinstance(values, dict) else (lambda key, default=None: getattr(values, key, default))
    sampling = {key: get(key) for key in SAMPLING_KEYS}  # as TRL passes them: top_k 0 is no top-k, min_p None none
    return sampling, int(get("max_completion_length") or 256)


def policy_fingerprint(model_name: str, init_dir: Path | None) -> str:
    """What the starting policy is: the earlier stage's saved adapter (or model) bytes, else the base model."""
    if init_dir is not None:
        saved = next((p for p in (Path(init_dir) / "adapter", Path(init_dir) / "model") if p.is_dir()), None)
        if saved is not None:
            weights = sorted(saved.glob("*.safetensors")) or sorted(saved.glob("*.bin"))
            return "+".join(file_sha256(p)[:16] for p in weights)
    from kitcli.models import gguf

    source = None if model_name == "tiny" else gguf.source_file(model_name)
    return model_name if source is None else f"{model_name}@{gguf.file_sha256(source)[:16]}"


def cache_key(*, policy: str, stage: FilteredSection, seed: int, k: int, sampling: dict[str, Any],
              max_new_tokens: int, rule: str, tool_rounds: int | None = None) -> str:
    """What the pass rates depend on (`stage`: the stage's typed section: its data, system prompt, rewards, tools)."""
    from kitcli.data.rows import fingerprint

    data = stage.data
    described = {"policy": policy, "data": fingerprint(data), "columns": data.columns, "limit": data.limit,
                 "chat": data.chat, "system_prompt": stage.system_prompt,
                 "rewards": [r.model_dump() for r in stage.rewards], "seed": seed, "k": k, "sampling": sampling,
                 "max_new_tokens": max_new_tokens, "pass": rule}
    tools = declared(stage, "tools")
    if tools:  # sampled with the tools live: which tools, and how many rounds of calls
        described.update(tools=[t.model_dump() for t in tools], tool_rounds=tool_rounds)
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_cached(path: Path | None) -> dict[int, Group]:
    from kitcli.rundir import read_jsonl

    if path is None:
        return {}
    return {record["index"]: Group.from_record(record) for record in read_jsonl(path)}


def measure_groups(model, tokenizer, rows: list[dict[str, Any]], rewards, rule, *, k: int, sampling: dict[str, Any],
                   max_new_tokens: int, seed: int, cache: Path | None = None, batch_size: int = 8,
                   log=None, toolbox=None) -> list[Group]:
    """k samples of each row's prompt, scored; prompts already in `cache` are not sampled again, and each batch
    is appended to it as soon as it is scored (a kill loses at most one batch). With a `toolbox`
    (kitcli/models/tool_loop.py) each sample is a conversation with the tools live, as the stage trains."""
    from kitcli.models.generate import sample
    from kitcli.models.tool_loop import sample_with_tools

    done = read_cached(cache)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(len(rows)) if i not in done]
    if done and log:
        log(f"filter: {len(done)} of {len(rows)} prompts' pass rates read from {cache}")
    for start in range(0, len(todo), batch_size):
        indices = todo[start:start + batch_size]
        batch = [rows[i] for i in indices]
        prompts = [row["prompt"] for row in batch]
        if toolbox is None:
            samples = sample(model, tokenizer, prompts, n=k, max_new_tokens=max_new_tokens, sampling=sampling,
                             batch_size=batch_size, seed=seed + indices[0])
        else:
            samples = sample_with_tools(model, tokenizer, prompts, toolbox, n=k, max_new_tokens=max_new_tokens,
                                        sampling=sampling, batch_size=batch_size, seed=seed + indices[0])
        groups = score_groups(rewards, rule, batch, samples)
        for index, group in zip(indices, groups):
            group.index = index
            done[index] = group
        if cache is not None:
            with open(cache, "a", encoding="utf-8") as f:
                for group in groups:
                    f.write(json.dumps(group.record()) + "\n")
        if log and (start // batch_size) % 10 == 9:
            log(f"filter: {len(done)}/{len(rows)} prompts sampled")
    return [done[i] for i in range(len(rows))]


def keep_within(groups: list[Group], min_pass: float, max_pass: float) -> list[int]:
    """Indices of the groups whose pass rate lies in [min_pass, max_pass]."""
    return [g.index for g in groups if min_pass - 1e-12 <= g.pass_rate <= max_pass + 1e-12]


def format_histogram(counts: list[int]) -> str:
    width = 1 / len(counts)
    return ", ".join(f"{i * width:.1f}-{(i + 1) * width:.1f}: {n}" for i, n in enumerate(counts) if n)


def filter_record(groups: list[Group], kept: list[int], spec: FilterSpec, rule_text: str,
                  key: str) -> dict[str, Any]:
    """What the DONE marker and the report hold of a filter (`spec`: the stage's `filter:`)."""
    kept_set = set(kept)
    before = summarize(groups)
    record = {"k": spec.k, "min_pass": spec.min_pass, "max_pass": spec.max_pass, "pass": rule_text,
              "cache_key": key, "prompts": len(groups), "kept": len(kept), "kept_share": len(kept) / len(groups),
              "below_min": sum(g.pass_rate < spec.min_pass - 1e-12 for g in groups),
              "above_max": sum(g.pass_rate > spec.max_pass + 1e-12 for g in groups),
              "pass_rate_histogram_before": before["pass_rate_histogram"],
              "pass_rate_histogram_after": histogram([g.pass_rate for g in groups if g.index in kept_set]),
              "zero_variance_share_before": before["zero_variance_share"],
              "truncated_share_before": before["truncated_share"]}
    if kept:
        after = summarize([g for g in groups if g.index in kept_set])
        record.update(zero_variance_share_after=after["zero_variance_share"],
                      truncated_share_after=after["truncated_share"])
    return record


def check_kept(record: dict[str, Any], needed: int, where: str) -> None:
    """Stop before training when the filter leaves nothing (or less than one generation batch) to train on."""
    if record["kept"] >= max(needed, 1):
        return
    faults = " and ".join(f"{bound} {record[bound]:g} removed {count}" for bound, count in
                          (("min_pass", record["below_min"]), ("max_pass", record["above_max"])) if count)
    short = "no prompt" if not record["kept"] else f"{record['kept']} prompts, fewer than the {needed} one " \
                                                   f"generation batch draws,"
    raise KitError(f"{where}: filter: kept {short} of {record['prompts']} (pass = {record['pass']}; pass rates "
                   f"over k={record['k']}: {format_histogram(record['pass_rate_histogram_before'])}); "
                   f"{faults}; widen the bounds or give other prompts")


def run_filter(*, model, tokenizer, rows: list[dict[str, Any]], rewards, stage: FilteredSection, model_name: str,
               init_dir: Path | None, values: Any, seed: int, where: str, cache_dir: Path | None,
               needed: int = 1, log=None, toolbox=None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows a stage's `filter:` keeps, and its record. `stage` is the stage's typed section (its `filter:`,
    data and rewards), `values` its resolved config; `toolbox` its tools (kitcli/training/tool_use.py
    stage_toolbox), with which each sample is a conversation."""
    spec = stage.filter
    rule = pass_rule(rewards, spec, where, [r.name for r in stage.rewards])
    sampling, max_new_tokens = sampling_settings(values)
    key = cache_key(policy=policy_fingerprint(model_name, init_dir), stage=stage, seed=seed, k=spec.k,
                    sampling=sampling, max_new_tokens=max_new_tokens, rule=rule.describe,
                    tool_rounds=None if toolbox is None else toolbox.max_iterations)
    cache = None if cache_dir is None else Path(cache_dir) / f"{key}.jsonl"
    if log:
        live = "" if toolbox is None else f" with {', '.join(toolbox.functions)} live"
        log(f"filter: sampling {spec.k} completions of each of {len(rows)} prompts from the starting policy{live} "
            f"(pass = {rule.describe}); keeping pass rates in [{spec.min_pass:g}, {spec.max_pass:g}]")
    groups = measure_groups(model, tokenizer, rows, rewards, rule, k=spec.k, sampling=sampling,
                            max_new_tokens=max_new_tokens, seed=seed, cache=cache, log=log, toolbox=toolbox)
    kept = keep_within(groups, spec.min_pass, spec.max_pass)
    record = filter_record(groups, kept, spec, rule.describe, key)
    record["max_completion_length"] = max_new_tokens  # what "truncated" was measured against (kit plan reads it)
    if cache_dir is not None:
        write_atomic(Path(cache_dir) / SUMMARY_NAME, json.dumps(record, indent=2))
    check_kept(record, needed, where)
    if log:
        log(f"filter: kept {record['kept']} of {record['prompts']} prompts ({record['kept_share']:.0%}); pass rates "
            f"before: {format_histogram(record['pass_rate_histogram_before'])}")
    return [rows[i] for i in kept], record


def filter_summary(stage_dir: Path, spec: FilterSpec | None) -> dict[str, Any]:
    """{"filter": record} for the stage's DONE when it filtered its prompts (`spec`: its `filter:`), else {}."""
    path = filter_dir(stage_dir) / SUMMARY_NAME
    if spec is None or not path.is_file():
        return {}
    return {"filter": json.loads(path.read_text())}
