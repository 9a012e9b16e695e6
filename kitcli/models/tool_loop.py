"""Multi-turn generation with tools, as TRL's GRPOTrainer runs it while training: generate a reply, parse it for
tool calls with the tokenizer's response template (TRL's `parse_response`), call the tools, append the assistant
turn and one `tool` turn per call, and generate again, up to `max_iterations` rounds of tool calls. A call that
raises (the kit's guarded tools raise a ToolError whose message is for the model) is answered with
`{'error': message}` and counted as a failure, as TRL does.

Greedy by default (an eval stage with `tools:`, `kit chat --tools`); with `sampling` (the stage's temperature, top_p,
top_k, min_p, repetition_penalty) it samples as the trainer does, which difficulty filtering with tools uses. With
`max_completion_length` the rounds share one token budget as in TRL: the tokens after the prompt (replies and tool
results) never exceed it, a tool result that would is dropped and the conversation ends there, and a reply cut at
the budget marks the conversation truncated. Without it each round may generate `max_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolConversation:
    """One prompt's conversation after the loop: the turns it added, its tool calls and failures, and whether its
    last reply was cut at the token limit."""

    turns: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    truncated: bool = False

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
                        batch_size: int = 32, sampling: dict[str, Any] | None = None, seed: int = 0,
                        max_completion_length: int | None = None) -> list[ToolConversation]:
    """Tool-calling conversations for conversational `prompts` (one each; repeat a prompt for several samples).
    Each batch of each round is seeded from `seed`, the round and the batch's first index."""
    import torch
    from transformers import GenerationConfig

    from kitcli.models.generate import stop_token_ids

    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stops), 0)
    mode = {"do_sample": True, **sampling} if sampling is not None else {"do_sample": False}
    results = [ToolConversation() for _ in prompts]
    prompt_ids = [render_ids(tokenizer, p, [], schemas) for p in prompts]
    active = list(range(len(prompts)))
    was_training = model.training
    model.eval()
    try:
        for round_number in range(max_iterations + 1):
            prefixes = {i: render_ids(tokenizer, prompts[i], results[i].turns, schemas) if round_number else
                        prompt_ids[i] for i in active}
            used = {i: len(prefixes[i]) - len(prompt_ids[i]) for i in active}  # replies and tool results so far
            if max_completion_length is not None:
                for i in active:
                    if used[i] >= max_completion_length:
                        drop_tool_results(results[i])
                active = [i for i in active if used[i] < max_completion_length]
            for start in range(0, len(active), batch_size):
                chunk = active[start:start + batch_size]
                budgets = [max_new_tokens if max_completion_length is None else max_completion_length - used[i]
                           for i in chunk]
                torch.manual_seed(seed * 1_000_003 + round_number * 10_007 + start)
                config = GenerationConfig(max_new_tokens=max(budgets), pad_token_id=pad, eos_token_id=sorted(stops),
                                          **mode)
                rows = [prefixes[i] for i in chunk]
                width = max(len(ids) for ids in rows)
                input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rows], device=model.device)
                attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows],
                                         device=model.device)
                with torch.no_grad():
                    output = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
                for row, index in enumerate(chunk):
                    take_reply(results[index], tokenizer, output[row, width:].tolist(), stops, budgets[row],
                               rows[row])
            waiting = []
            for index in active:
                calls = results[index].turns[-1].get("tool_calls") or []
                if not calls or round_number == max_iterations or results[index].truncated:
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
        model.train(was_training)
    return results


def render_ids(tokenizer, prompt: list[dict[str, Any]], turns: list[dict[str, Any]],
               schemas: list[dict[str, Any]], generation_prompt: bool = True) -> list[int]:
    """Token ids of the conversation so far, as the chat template renders it (and the next reply's header)."""
    text = tokenizer.apply_chat_template(prompt + turns, tools=schemas, add_generation_prompt=generation_prompt,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def drop_tool_results(conversation: ToolConversation) -> None:
    """What TRL does with tool results that would push a completion past its budget: drops them, and the
    conversation ends at the call."""
    while conversation.turns and conversation.turns[-1].get("role") == "tool":
        conversation.turns.pop()


def take_reply(conversation: ToolConversation, tokenizer, new: list[int], stops: set[int], budget: int,
               prefix: list[int]) -> None:
    """Append one generated reply (cut at its stop token or its budget) as a parsed assistant turn."""
    from trl.chat_template_utils import parse_response

    end = next((i for i, t in enumerate(new) if t in stops), None)
    ids = new[:budget] if end is None or end >= budget else new[:end + 1]
    conversation.truncated = end is None or end >= budget
    reply = parse_response(tokenizer, ids, prefix=prefix) if ids else {"role": "assistant", "content": ""}
    conversation.turns.append({"role": "assistant", **reply})


@dataclass(frozen=True)
class Toolbox:
    """What a sampler needs of a stage's tools: the guarded functions by name, their schemas for the chat template,
    and the rounds of calls a completion may make."""

    functions: dict[str, Any]
    schemas: list[dict[str, Any]]
    max_iterations: int


def sample_with_tools(model, tokenizer, prompts: list[list[dict[str, Any]]], toolbox: Toolbox, *, n: int,
                      max_new_tokens: int, sampling: dict[str, Any], batch_size: int = 8,
                      seed: int = 0) -> list[list[tuple[list[dict[str, Any]], list[int], bool]]]:
    """`n` sampled tool-calling conversations of each prompt, as GRPOTrainer draws them with tools: for each prompt
    a list of (the turns after the prompt, their token ids as the chat template renders them, truncated), in the
    shape of kitcli.models.generate.sample's output. The rounds share max_new_tokens as TRL's completions share
    max_completion_length. Each batch of prompts is seeded from `seed` and its first prompt's index."""
    groups: list[list[tuple[list[dict[str, Any]], list[int], bool]]] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        conversations = generate_with_tools(model, tokenizer, [p for p in batch for _ in range(n)],
                                            toolbox.functions, toolbox.schemas, max_new_tokens=max_new_tokens,
                                            max_iterations=toolbox.max_iterations,
                                            batch_size=len(batch) * n, sampling=sampling, seed=seed + start,
                                            max_completion_length=max_new_tokens)
        for row, prompt in enumerate(batch):
            prompt_ids = render_ids(tokenizer, prompt, [], toolbox.schemas)
            group = []
            for conversation in conversations[row * n:(row + 1) * n]:
                ids = render_ids(tokenizer, prompt, conversation.turns, toolbox.schemas, generation_prompt=False)
                group.append((conversation.turns, ids[len(prompt_ids):], conversation.truncated))
            groups.append(group)
    return groups
