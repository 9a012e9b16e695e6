"""Greedy multi-turn generation with tools, as TRL's GRPOTrainer runs it while training (an eval stage with
`tools:` uses it): generate a reply, parse it for tool calls with the tokenizer's response template (TRL's
`parse_response`), call the tools, append the assistant turn and one `tool` turn per call, and generate again, up to
`max_iterations` rounds of tool calls. A call that raises (the kit's guarded tools raise a ToolError whose message
is for the model) is answered with `{'error': message}` and counted as a failure, as TRL does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolConversation:
    """One prompt's conversation after the loop: the turns it added, its tool calls and failures."""

    turns: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    failures: int = 0

    @property
    def final_answer(self) -> str:
        """The last assistant turn's content; none when the conversation ends on a tool turn."""
        if not self.turns or self.turns[-1].get("role") != "assistant":
            return ""
        return str(self.turns[-1].get("content") or "")


def call_tool(call: dict[str, Any], tools: dict[str, Any]) -> tuple[str, Any, bool]:
    """(name, result, failed) of one parsed tool call."""
    function = call.get("function") or {}
    name = function.get("name", "unknown")
    try:
        if call.get("type", "function") != "function":
            raise ValueError(f"Unsupported tool call type: {call.get('type')}")
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        return name, tools[name](**(function.get("arguments") or {})), False
    except Exception as error:  # noqa: BLE001  (as TRL: the model reads the error, the loop goes on)
        return name, {"error": str(error)}, True


def generate_with_tools(model, tokenizer, prompts: list[list[dict[str, Any]]], tools: dict[str, Any],
                        schemas: list[dict[str, Any]], *, max_new_tokens: int, max_iterations: int,
                        batch_size: int = 32) -> list[ToolConversation]:
    """Greedy tool-calling conversations for conversational `prompts`; each round generates at most
    `max_new_tokens` for every conversation still waiting for a reply."""
    import torch
    from trl.chat_template_utils import parse_response

    from kitcli.models.generate import stop_token_ids

    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stops), 0)
    results = [ToolConversation() for _ in prompts]
    active = list(range(len(prompts)))
    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    try:
        for round_number in range(max_iterations + 1):
            for start in range(0, len(active), batch_size):
                chunk = active[start:start + batch_size]
                rendered = [tokenizer.apply_chat_template(prompts[i] + results[i].turns, tools=schemas,
                                                          add_generation_prompt=True, tokenize=False) for i in chunk]
                batch = tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
                batch = batch.to(model.device)
                with torch.no_grad():
                    output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                            eos_token_id=sorted(stops))
                for row, index in enumerate(chunk):
                    new = output[row, batch["input_ids"].shape[1]:].tolist()
                    end = next((i for i, t in enumerate(new) if t in stops), None)
                    ids = new if end is None else new[:end + 1]
                    prefix = tokenizer(rendered[row], add_special_tokens=False)["input_ids"]
                    reply = parse_response(tokenizer, ids, prefix=prefix) if ids else {"role": "assistant",
                                                                                         "content": ""}
                    results[index].turns.append({"role": "assistant", **reply})
            waiting = []
            for index in active:
                calls = results[index].turns[-1].get("tool_calls") or []
                if not calls or round_number == max_iterations:
                    continue
                for call in calls:
                    name, result, failed = call_tool(call, tools)
                    results[index].calls += 1
                    results[index].failures += failed
                    results[index].turns.append({"role": "tool", "name": name, "content": str(result)})
                waiting.append(index)
            active = waiting
            if not active:
                break
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return results
