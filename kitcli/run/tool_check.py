"""What `kit check` measures in a stage with tools (kitcli/run/check.py asks): prompts as TRL renders them, with the
tools' schemas in the system turn, and the room a tool call, its result and the answer need.

TRL 1.15's GRPOTrainer caps the whole completion, tool calls and results included, at `max_completion_length`, and
drops a tool result that would pass the cap: the completion then ends at the call, with no answer, and scores 0 (a
calculator call of two three-digit factors is 83 tokens for the tiny byte-level tokenizer). The eval loop caps each
round at `generation.max_new_tokens`, so a call longer than that is cut before it closes and never runs. The call is
estimated from the first tool's schema, each required argument as long as the row's answer; the result is the
answer itself.
"""

from __future__ import annotations

import json
from typing import Any

from kitcli.recipe.stage_context import StageContext
from kitcli.run.findings import Finding, cut_finding


def row_schemas(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A tool-calling data row's `tools` column (a list, or a JSON string of one), as TRL passes it to the template."""
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def tool_turns(schema: dict[str, Any], answer: str) -> list[dict[str, Any]]:
    """One call to the tool (its required arguments each as long as the answer), the answer as its result, the
    answer as the reply."""
    function = schema.get("function", schema)
    parameters = function.get("parameters") or {}
    required = parameters.get("required") or list(parameters.get("properties") or {})
    call = {"type": "function", "function": {"name": function["name"], "arguments": {n: answer for n in required}}}
    return [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "name": function["name"], "content": answer},
            {"role": "assistant", "content": answer}]


def tool_length_findings(ctx: StageContext, rows: list[dict[str, Any]], values: dict[str, Any], render,
                         generation: dict[str, Any], schemas: list[dict[str, Any]]) -> list[Finding]:
    """An RL or eval stage with tools: prompt with schemas + room against max_seq_length, and a call + result +
    answer against max_completion_length (GRPO / GSPO) or the call against generation.max_new_tokens (eval)."""
    stage, is_eval = ctx.name, ctx.spec.evaluates
    chats = [r for r in rows if isinstance(r.get("prompt"), list)]
    prompt_lengths = render.counts([render.prompt(r["prompt"], schemas) for r in chats])
    room = generation["max_new_tokens"] if is_eval else values.get("max_completion_length") or 0
    found = [cut_finding(stage, f"prompt with tool schemas + {room} new tokens", [n + room for n in prompt_lengths],
                         ctx.model.max_seq_length, "model.max_seq_length")]
    answered = [(r, n) for r, n in zip(chats, prompt_lengths) if isinstance(r.get("answer"), (str, int, float))]
    if not answered or not room:
        return found
    if is_eval:  # each round is capped on its own: the call must close within max_new_tokens
        turns, what, setting = 1, "one tool call", "generation.max_new_tokens"
    else:
        turns, what, setting = 3, "one tool call + its result + the answer", "train.max_completion_length"
    ends = render.counts([render.whole(r["prompt"], tool_turns(schemas[0], str(r["answer"]))[:turns], eos=False,
                                       tools=schemas) for r, _ in answered])
    lengths = [end - n for end, (_, n) in zip(ends, answered)]
    check = cut_finding(stage, what, lengths, room, setting)
    check.verdict = check.verdict.replace("would be cut", "cannot fit a correct completion")
    return found + [check]
