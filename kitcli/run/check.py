"""`kit check`: what a recipe will do to its data, found before any GPU time is spent.

    kit check smol-grpo                    # the cheap part: the tokenizer and the data only (no model, no torch)
    kit check smol-grpo --signal 16        # also sample the RL stages' starting policies (kitcli/run/signal_check.py)

Per stage, from the model's real tokenizer and the stage's rows as the stage reads them (columns, chat, system
prompt): token lengths of prompts, completions and whole rows (p50 / p95 / max) against the settings that cut them
(SFT / DPO / KTO / reward max_length, RL max_completion_length and model.max_seq_length, an eval's max_new_tokens),
with the share cut and the setting that fixes it; the batch arithmetic (generation batch and num_generations,
steps per epoch, total steps, the warm-up share); the chat template (conversational data without one, a generation
prompt that already opens a tag a format reward wants the completion to open, the stop token absent from SFT
targets). Each finding is one row with a verdict; `warn` findings become errors (exit 2) with `--strict` or
`check: strict` in the recipe. `kit run` runs this part before its first stage and `kit run --dry-run` prints it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from kitcli.errors import KitError, faults_of
from kitcli.models.chat_template import with_template_text
from kitcli.recipe.load import Recipe
from kitcli.recipe.schema import declared
from kitcli.recipe.stage_context import StageContext
from kitcli.run.batch_check import batch_findings
from kitcli.run.findings import Finding, cut_finding
from kitcli.run.rendering import Renderer
from kitcli.run.reward_check import best_checkpoint_findings, reward_findings
from kitcli.run.settings_check import kit_default_findings, position_findings, unused_findings
from kitcli.run.speed_check import speed_findings
from kitcli.run.template_check import template_findings
from kitcli.run.tool_check import row_schemas, tool_length_findings
from kitcli.training.tool_use import stage_schemas

LENGTH_ROWS = 1000  # rows whose token lengths are measured (evenly spaced over larger datasets)


# --- the pieces a check reads --------------------------------------------------------------------------------------

def load_tokenizer(name: str):
    """The model's own tokenizer: the tiny model's, a GGUF file's converted one (converted on first use), a local
    directory's or a hub model's from the local Hugging Face cache (None when it is not there)."""
    from kitcli.models import gguf

    if name == "tiny":
        from kitcli.models.tiny import ensure_tiny_model

        folder = ensure_tiny_model()
    else:
        source = gguf.source_file(name)
        folder = Path(name) if source is None else gguf.converted_dir(gguf.file_sha256(source))
        if source is not None and not (folder / "tokenizer_config.json").is_file():
            from kitcli import libraries

            with libraries.library_output():  # the conversion's progress bars go to libraries.log, not the table
                folder = gguf.ensure_converted(source, log=lambda message: None)
    return tokenizer_in(str(folder))


@functools.lru_cache(maxsize=8)
def tokenizer_in(folder: str):
    """A folder's tokenizer, loaded once per process (a dry run checks every stage; the only use here is reading)."""
    from transformers import AutoTokenizer

    try:  # a hub model's tokenizer only from the local cache: a check downloads nothing
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception:  # noqa: BLE001  (offline, gated, no tokenizer files: the check says so)
        return None


def resolved_values(ctx: StageContext) -> dict[str, Any]:
    """The stage's trainer settings as its config will hold them, without importing TRL: the config class's own
    defaults (read from its source), the kit's defaults, the stage type's, then `train:`."""
    from kitcli.recipe.config_fields import MISSING, config_fields
    from kitcli.training.trl_config import COMMON_DEFAULTS

    spec = ctx.spec
    values = {name: f.default for name, f in config_fields(spec.config).items()
              if f.default is not MISSING} if spec.config is not None else {}
    values.update(COMMON_DEFAULTS)
    if spec.defaults is not None:
        values.update(spec.defaults(ctx, on_gpu=False))
    values.update(declared(ctx.stage, "train") or {})
    return values


def stage_rows(ctx: StageContext) -> list[dict[str, Any]] | None:
    """The rows as the stage reads them (None for a hub dataset: not read by the cheap check)."""
    from kitcli.data.rows import apply_system_prompt, read_rows

    spec = declared(ctx.stage, "data")
    if spec is None or not Path(spec.path).is_file():
        return None
    kind = ctx.spec
    if kind.rows.read is not None:
        return kind.rows.read(ctx)
    rows = read_rows(spec, ctx.where)
    if kind.rows.as_trained is not None:  # e.g. KTO unpairs pairs
        rows = kind.rows.as_trained(rows)
    keys = ("prompt", "completion", "chosen", "rejected", "messages", "text", "answer", "tools")
    rows = [{k: r[k] for k in keys if k in r} for r in rows]
    system = declared(ctx.stage, "system_prompt")
    if system and any("prompt" in r or "messages" in r for r in rows[:1]):
        rows = apply_system_prompt(rows, system, ctx.where, spec.path)
    return rows


def evenly_spaced(rows: list[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """At most `most` rows, spread evenly over the data: rendering and tokenizing every row of a large dataset
    would make the check slow (3,000 tool traces took about 2 s, so 100,000 rows would take a minute)."""
    if len(rows) <= most:
        return rows
    return [rows[i * len(rows) // most] for i in range(most)]


# --- the checks --------------------------------------------------------------------------------------------------

def length_findings(ctx: StageContext, rows: list[dict[str, Any]], values: dict[str, Any], render: Renderer,
                    generation: dict[str, Any] | None) -> list[Finding]:
    stage, seq = ctx.name, ctx.model.max_seq_length
    spec = ctx.spec
    shape, evaluates = spec.rows.shape, spec.evaluates
    if shape is None:
        return [Finding(stage, "lengths", "warn", f"stage type '{spec.type}'",
                        "kit check has no length check for this stage type (its StageSpec gives no "
                        "rows=Rows(shape=...)), so nothing says whether its rows fit; see docs/extending.md")]
    found: list[Finding] = []
    prompts = render.counts([render.prompt(r["prompt"], row_schemas(r)) for r in rows if "prompt" in r])
    if shape == "prompts":
        room = (values.get("max_completion_length") or values.get("response_length") or 0) if not evaluates \
            else generation["max_new_tokens"]
        name = "generation.max_new_tokens" if evaluates else "train.max_completion_length"
        found.append(cut_finding(stage, f"prompt + {room} new tokens", [n + room for n in prompts], seq,
                                 "model.max_seq_length"))
        answers = [n + (0 if evaluates else 1) for n in render.counts(
            [str(r["answer"]) for r in rows if "answer" in r and isinstance(r["answer"], (str, int, float))])]
        if answers and room:
            check = cut_finding(stage, "reference answer" + (" + stop token" if not evaluates else ""), answers,
                                room, name)
            check.verdict = check.verdict.replace("would be cut", "cannot fit a correct completion")
            found.append(check)
        return found
    limit = values.get("max_length")
    if shape == "text":
        texts, paired = [], []
        for r in rows:
            if "messages" in r:
                texts.append(render.render(r["messages"], row_schemas(r), False))
            elif "text" in r:
                texts.append(str(r["text"]) + (render.tokenizer.eos_token or ""))
            else:
                texts.append(render.whole(r["prompt"], r["completion"], eos=True, tools=row_schemas(r)))
                paired.append((len(texts) - 1, render.prompt(r["prompt"], row_schemas(r))))
        wholes = render.counts(texts)
        replies = [wholes[i] - n for (i, _), n in zip(paired, render.counts([text for _, text in paired]))]
        if prompts:
            found.append(cut_finding(stage, "prompts", prompts, None, ""))
        if replies:
            found.append(cut_finding(stage, "completions", replies, None, ""))
        found.append(cut_finding(stage, "whole rows", wholes, limit, "train.max_length"))
        return found
    if shape == "pairs":
        for side in ("chosen", "rejected", "completion"):
            lengths = render.counts([render.whole(r.get("prompt", ""), r[side], eos=True) for r in rows if side in r])
            if lengths:
                found.append(cut_finding(stage, f"prompt + {side}", lengths, limit, "train.max_length"))
    return found


def filter_findings(ctx: StageContext, rows: list[dict[str, Any]], rewards: list) -> list[Finding]:
    """A stage's `filter:`: what it will sample and what passes (a pass rule it cannot form is an error here), with
    the rewards reward_findings resolved."""
    from kitcli.training.signal import pass_rule

    spec = declared(ctx.stage, "filter")
    if spec is None:
        return []
    rule = pass_rule(rewards, spec, ctx.where, [r.name for r in ctx.stage.rewards])
    return [Finding(ctx.name, "filter", "info", f"{spec.k} samples x {len(rows)} prompts = "
                                                f"{spec.k * len(rows)} completions before training",
                    f"keeps pass rates in [{spec.min_pass:g}, {spec.max_pass:g}]; pass = {rule.describe}")]


# --- running them ------------------------------------------------------------------------------------------------

def check_recipe(recipe: Recipe, run_dir: Path | None = None, console=None,
                 faults: list[str] | None = None, faulted: frozenset[str] = frozenset()) -> list[Finding]:
    """Every cheap finding of every stage, in stage order. A stage's fault (a reward that does not resolve, rows
    without a column) is raised, or with `faults` added to it and the next stage checked (kitcli/run/preflight.py).
    `faulted`: stages whose description already faulted (their data unreadable, say): what else their check finds
    is added, and a failure that follows from the fault already named is not a second one."""
    from rich.console import Console

    console = console or Console(quiet=True)
    run_dir = run_dir or Path("runs") / f"{recipe.name}-CHECK"
    tokenizer = with_template_text(load_tokenizer(recipe.model.name), recipe.model.chat_template)
    outputs = {s.name: run_dir / s.name for s in recipe.stages}
    found: list[Finding] = []
    for stage in recipe.stages:
        if stage.name in recipe.defaulted:  # a bad value set aside: what follows from its default is no fault
            continue
        ctx = StageContext(recipe, stage, run_dir, console, outputs)
        try:
            found += stage_findings(ctx, tokenizer)
        except KitError as error:
            if faults is None:
                raise
            faults += faults_of(error)
        except Exception:  # only where a fault of the stage was already named
            if ctx.name not in faulted:
                raise
    if tokenizer is None:
        found.append(Finding("model", "tokenizer", "info", recipe.model.name,
                             "its tokenizer is not available here (offline?), so lengths were not measured"))
    return found


def stage_findings(ctx: StageContext, tokenizer) -> list[Finding]:
    """One stage's cheap findings (only its rewards without a tokenizer: they need no model)."""
    evaluates = ctx.spec.evaluates
    found: list[Finding] = []
    if tokenizer is None:
        found = reward_findings(ctx, stage_rows(ctx))[0]
        return found + ([] if evaluates else kit_default_findings(ctx))
    render = Renderer(tokenizer)
    rows = stage_rows(ctx)
    resolved, rewards = reward_findings(ctx, rows)
    found += resolved
    if rows is None:
        data = declared(ctx.stage, "data")
        if data is not None:  # an eval stage with tasks: (lm-eval benchmarks) has no data
            found.append(Finding(ctx.name, "data", "info", data.path, "a hub dataset: read when it runs"))
        return found
    values = resolved_values(ctx) if not evaluates else {}
    given = declared(ctx.stage, "generation")  # an eval stage's
    generation = {"max_new_tokens": 32, **(given.model_dump() if given is not None else {})}
    template = template_findings(ctx, rows, render)
    schemas, measured = stage_schemas(ctx.stage, ctx.recipe.base_dir, ctx.where), evenly_spaced(rows, LENGTH_ROWS)
    if any(f.topic == "chat template" for f in template):  # conversations it cannot render: not measured
        pass
    elif schemas:
        found += tool_length_findings(ctx, measured, values, render, generation, schemas)
    else:
        found += length_findings(ctx, measured, values, render, generation)
    if len(measured) < len(rows):
        found.append(Finding(ctx.name, "lengths", "info", f"{len(measured):,} of {len(rows):,} rows, evenly "
                                                          f"spaced", "lengths measured on a sample (the shares "
                                                                     "cut are estimates)"))
    found += batch_findings(ctx, len(rows), values) + best_checkpoint_findings(ctx, values)
    found += template + filter_findings(ctx, rows, rewards) + speed_findings(ctx)
    if values:  # a training stage: what it sets that nothing reads, lengths beyond the positions, the kit's defaults
        found += unused_findings(ctx, rows, values) + position_findings(ctx, values, tokenizer)
        found += kit_default_findings(ctx)
    return found


def findings_table(findings: list[Finding], title: str = "kit check"):
    from rich.table import Table

    table = Table(title=title)
    for column in ("stage", "check", "figures", "verdict"):
        table.add_column(column, overflow="fold")
    marks = {"warn": "[yellow]warn[/yellow] ", "ok": "[green]ok[/green] ", "info": ""}
    for f in findings:
        table.add_row(f.stage, f.topic, f.figures, marks[f.level] + f.verdict)
    return table


def enforce(findings: list[Finding], strict: bool, source: str) -> None:
    """With --strict (or `check: strict`), any warning is an error: exit 2, naming the first."""
    warnings = [f for f in findings if f.level == "warn"]
    if strict and warnings:
        more = f" (and {len(warnings) - 1} more)" if len(warnings) > 1 else ""
        raise KitError(f"{source}: kit check (strict): {warnings[0].line()}{more}; fix it, or drop --strict / "
                       f"check: strict to make findings warnings")
