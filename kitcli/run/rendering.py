"""How `kit check` renders and counts a stage's rows as TRL renders them (kitcli/run/check.py measures them)."""

from __future__ import annotations

import json
import weakref
from typing import Any


def is_chat(value: Any) -> bool:
    return isinstance(value, list)


MEMO_LIMIT = 200_000  # texts (and rendered conversations) remembered per tokenizer
MEMOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its remembered counts and renders


class Renderer:
    """Token counts of prompts and replies as TRL renders them (chat template for conversations, EOS appended to
    plain-string SFT completions). A text's count and a conversation's rendering depend only on the tokenizer (and
    its chat template, part of the key), so they are remembered per tokenizer object (tokenizer_in loads each once
    per process): a dry run that checks several stages on one file, or many recipes in one process, renders and
    counts each row once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.memo = MEMOS.setdefault(tokenizer, {"counts": {}, "renders": {}})

    def counts(self, texts: list[str]) -> list[int]:
        """Token counts of many texts in one call (the fast tokenizer encodes a batch in Rust, in one go)."""
        known = self.memo["counts"]
        new = list(dict.fromkeys(t for t in texts if t not in known))
        if new:
            if len(known) + len(new) > MEMO_LIMIT:
                known.clear()
            known.update(zip(new, (len(ids) for ids in self.tokenizer(new, add_special_tokens=False)["input_ids"])))
        return [known[t] for t in texts]

    def render(self, turns: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        key = (hash(self.tokenizer.chat_template), json.dumps([turns, tools, generation_prompt], sort_keys=True,
                                                              default=str))
        renders = self.memo["renders"]
        if key not in renders:
            if len(renders) >= MEMO_LIMIT:
                renders.clear()
            renders[key] = self.tokenizer.apply_chat_template(turns, tools=tools, tokenize=False,
                                                              add_generation_prompt=generation_prompt)
        return renders[key]

    def prompt(self, prompt: Any, tools: list[dict] | None = None) -> str:
        return self.render(prompt, tools, True) if is_chat(prompt) else str(prompt)

    def whole(self, prompt: Any, reply: Any, eos: bool, tools: list[dict] | None = None) -> str:
        if is_chat(prompt) or is_chat(reply):
            turns = (prompt if is_chat(prompt) else [{"role": "user", "content": str(prompt)}]) + \
                (reply if is_chat(reply) else [{"role": "assistant", "content": str(reply)}])
            return self.render(turns, tools, False)
        return str(prompt) + str(reply) + (self.tokenizer.eos_token or "" if eos else "")
