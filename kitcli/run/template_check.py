"""`kit check`'s chat template: conversational rows without a template, a generation prompt that already opens a tag a
format reward wants the completion to open, the stop token absent after an SFT target's reply."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kitcli.recipe.schema import declared
from kitcli.recipe.stage_context import StageContext
from kitcli.run.findings import Finding
from kitcli.run.rendering import Renderer, is_chat
from kitcli.run.tool_check import row_schemas

TAG_REWARDS = ("format", "tag_credit")  # built-ins that want the completion to open tags (default think, answer)


def stop_tokens(tokenizer) -> set[str]:
    """The tokens generation stops on: the tokenizer's EOS and the model folder's generation_config.json EOS ids."""
    import json

    stops = {tokenizer.eos_token} if tokenizer.eos_token else set()
    config = Path(getattr(tokenizer, "name_or_path", "")) / "generation_config.json"
    if config.is_file():
        ids = json.loads(config.read_text()).get("eos_token_id")
        for token_id in ids if isinstance(ids, list) else [ids] if ids is not None else []:
            stops.add(tokenizer.convert_ids_to_tokens(int(token_id)))
    return stops


def opened_tags(text: str) -> list[str]:
    """Tags a text opens and does not close, e.g. a generation prompt ending in `<think>\\n`."""
    return [t for t in re.findall(r"<([A-Za-z_][\w-]*)>", text) if f"</{t}>" not in text]


def template_findings(ctx: StageContext, rows: list[dict[str, Any]], render: Renderer) -> list[Finding]:
    stage, tokenizer = ctx.name, render.tokenizer
    first = rows[0]
    chat = any(is_chat(first.get(k)) for k in ("prompt", "completion", "chosen", "messages"))
    if not chat:
        return []
    if getattr(tokenizer, "chat_template", None) is None:
        return [Finding(stage, "chat template", "warn", "conversational rows",
                        "the model has no chat template, so conversations cannot be rendered; give plain-string "
                        "data (remove chat: true) or a model with a template")]
    found = []
    prompt = first.get("prompt") or first.get("messages")[:-1]
    if is_chat(prompt) and prompt:
        closed = tokenizer.apply_chat_template(prompt, tokenize=False)
        opened = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        tags = opened_tags(opened[len(closed):] if opened.startswith(closed) else "")
        wanted = [(r.name, r.args) for r in declared(ctx.stage, "rewards") or []]
        clashes = [(name, t) for name, args in wanted if name in TAG_REWARDS
                   for t in tags if t in (args.get("tags") or ("think", "answer"))]
        if clashes:
            name, tag = clashes[0]
            found.append(Finding(stage, "generation prompt", "warn", f"ends with <{tag}>",
                                 f"the template opens <{tag}> before the completion starts, so reward '{name}' "
                                 f"(which wants the completion to open <{tag}>) can never pay; drop <{tag}> from its "
                                 f"tags or turn the template's thinking prefill off"))
        elif tags:
            found.append(Finding(stage, "generation prompt", "info", f"ends with <{tags[0]}>",
                                 f"completions start inside <{tags[0]}>"))
    if ctx.spec.rows.shape == "text":  # supervised targets: the reply must end in a stop
        stops = stop_tokens(tokenizer)
        after = reply_end(first, render)
        present = [s for s in stops if s and s in after]
        found.append(Finding(stage, "stop token in targets", "ok" if present else "warn",
                             f"after the reply: {after.strip()!r:.40}; stops on {', '.join(sorted(stops))}",
                             "the model learns to stop" if present else
                             "no stop token follows the reply, so the trained model never learns to stop; use a "
                             "template that ends the assistant turn with its EOS"))
    return found


def reply_end(row: dict[str, Any], render: Renderer) -> str:
    """What the template writes after the text of an SFT row's last reply, where its stop token must be; for a
    reply that is a tool call (no text of its own), all the template writes for that turn."""
    if "messages" not in row and not is_chat(row.get("completion")):
        text, reply = render.whole(row["prompt"], row["completion"], eos=True), str(row["completion"])
        return text[text.rfind(reply) + len(reply):] if reply in text else ""
    turns = row.get("messages") or (row["prompt"] if is_chat(row["prompt"]) else
                                    [{"role": "user", "content": str(row["prompt"])}]) + row["completion"]
    tools = row_schemas(row)
    text = render.tokenizer.apply_chat_template(turns, tools=tools, tokenize=False)
    reply = turns[-1].get("content") or ""
    if turns[-1].get("tool_calls") or not reply:
        before = render.tokenizer.apply_chat_template(turns[:-1], tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        return text[len(before):] if text.startswith(before) else ""
    return text[text.rfind(reply) + len(reply):] if reply in text else ""
