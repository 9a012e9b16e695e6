"""A PPO rollout: one response per prompt sampled from the policy, scored by the reward functions and/or the reward
model, with the policy's and the reference's log-probabilities and the critic's values of every response token."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from kitcli.errors import KitError
from kitcli.ppo.config import PPOConfig
from kitcli.ppo.models import (
    CRITIC,
    POLICY,
    PPOModels,
    RewardModel,
    hidden_states,
    policy_logprobs,
    reference_logprobs,
    response_values,
    use_adapter,
)

REWARD_ARGS = {"prompts", "completions", "completion_ids", "kwargs"}


def prompt_texts(tokenizer, prompts: list[Any]) -> list[str]:
    from kitcli.models.generate import prompt_text

    return [prompt_text(tokenizer, p) for p in prompts]


# --- checks before training -------------------------------------------------------------------------------------

def check_reward_columns(rewards, rows: list[dict[str, Any]], where: str, path: str) -> None:
    """A reward's required keyword arguments (e.g. exact_match's `answer`) must be dataset columns."""
    for reward in rewards:
        try:
            parameters = inspect.signature(reward.fn).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in parameters:
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.default is not p.empty or p.name in REWARD_ARGS:
                continue
            if p.name not in rows[0]:
                raise KitError(f"{where}: reward '{reward.name}' needs the column '{p.name}', which '{path}' does not "
                               f"have (columns: {', '.join(sorted(rows[0]))}); add it or map one with columns:")


def check_prompt_lengths(tokenizer, rows: list[dict[str, Any]], config: PPOConfig, max_seq_length: int, where: str,
                         path: str) -> None:
    limit = max_seq_length - config.response_length
    for index, text in enumerate(prompt_texts(tokenizer, [r["prompt"] for r in rows])):
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length > limit:
            raise KitError(f"{where}: the prompt of row {index} of '{path}' is {length} tokens; with "
                           f"train.response_length {config.response_length} it exceeds model.max_seq_length "
                           f"{max_seq_length}; raise max_seq_length or lower response_length")


# --- scoring ----------------------------------------------------------------------------------------------------

def reward_model_inputs(reward_model: RewardModel, prompts: list[Any], completions: list[str]):
    """The conversation (or text) as the reward stage saw it: TRL's RewardTrainer applies the chat template to
    prompt + assistant turn; plain text gets the end-of-sequence token appended."""
    tokenizer = reward_model.tokenizer
    sequences = []
    for prompt, completion in zip(prompts, completions):
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}],
                                                tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer(str(prompt) + completion + tokenizer.eos_token)["input_ids"]  # as TRL: `text=` call
        sequences.append(list(ids))
    return sequences


def score_with_reward_model(models: PPOModels, prompts: list[Any], completions: list[str], batch_size: int):
    reward_model = models.reward_model
    sequences = reward_model_inputs(reward_model, prompts, completions)
    pad = reward_model.tokenizer.pad_token_id
    device = models.model.device if reward_model.adapter else reward_model.model.device
    scores = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=device)
        with torch.no_grad():
            if reward_model.adapter:
                use_adapter(models, reward_model.adapter)
                hidden = hidden_states(models, ids, mask)
                last = hidden[torch.arange(len(chunk), device=device), mask.sum(1) - 1]
                scores.append(reward_model.head(last.to(reward_model.head.weight.dtype)).squeeze(-1).float())
            else:
                scores.append(reward_model.model(input_ids=ids, attention_mask=mask).logits[:, 0].float())
    use_adapter(models, POLICY)
    return torch.cat(scores)


def score_responses(models: PPOModels, reward_fns, rewards, rows: list[dict[str, Any]], completions: list[str],
                    batch_size: int) -> tuple[Any, dict[str, float]]:
    """score = sum of weight * reward over the reward functions and the reward model (None counts as 0)."""
    prompts = [row["prompt"] for row in rows]
    conversational = isinstance(prompts[0], list)
    shown = [[{"role": "assistant", "content": c}] for c in completions] if conversational else completions
    columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"}
    total = torch.zeros(len(rows))
    metrics: dict[str, float] = {}
    for fn, reward in zip(reward_fns, rewards):
        values = fn(prompts=prompts, completions=shown, **columns)
        scored = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
        metrics[f"rewards/{reward.name}/mean"] = float(torch.nanmean(scored)) if (~scored.isnan()).any() else math.nan
        total += reward.weight * torch.nan_to_num(scored, nan=0.0)
    if models.reward_model is not None:
        scored = score_with_reward_model(models, prompts, completions, batch_size).cpu()
        metrics["rewards/reward_model/mean"] = float(scored.mean())
        total += models.reward_model.weight * scored
    return total, metrics


# --- the rollout ------------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    input_ids: Any  # [B, P + R]: left-padded prompts, then the responses (padding after the end)
    attention_mask: Any
    prompt_length: int
    mask: Any  # [B, R] 1 for response tokens up to and including the end-of-sequence token
    logprobs: Any
    ref_logprobs: Any
    values: Any
    scores: Any
    entropy: Any
    completions: list[str]
    has_eos: Any


def generate_responses(models: PPOModels, rows: list[dict[str, Any]], config: PPOConfig):
    """Sample one response per prompt from the policy: full softmax at `temperature` (no top-k / top-p)."""
    tokenizer = models.tokenizer
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(prompt_texts(tokenizer, [r["prompt"] for r in rows]), return_tensors="pt", padding=True,
                          add_special_tokens=False).to(models.model.device)
    finally:
        tokenizer.padding_side = padding_side
    use_adapter(models, POLICY)
    models.model.eval()
    with torch.no_grad():
        output = models.model.generate(
            **batch, max_new_tokens=config.response_length, do_sample=True, temperature=config.temperature,
            top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, use_cache=True)
    prompt_length = batch["input_ids"].shape[1]
    responses = output[:, prompt_length:]
    is_eos = responses == tokenizer.eos_token_id
    has_eos = is_eos.any(1)
    first_eos = torch.where(has_eos, is_eos.float().argmax(1), torch.full_like(has_eos, responses.shape[1] - 1,
                                                                               dtype=torch.long))
    mask = (torch.arange(responses.shape[1], device=responses.device)[None, :] <= first_eos[:, None]).long()
    attention_mask = torch.cat([batch["attention_mask"], mask], dim=1)
    texts = [tokenizer.decode(r[: int(m.sum())], skip_special_tokens=True) for r, m in zip(responses, mask)]
    return output, attention_mask, prompt_length, mask.float(), texts, has_eos


def make_rollout(models: PPOModels, rows, config: PPOConfig, reward_fns, rewards,
                 accelerator) -> tuple[Rollout, dict]:
    """Sample, score, and take the log-probabilities and values under `accelerator.autocast()`, the autocast the
    update runs under too: the first update's ratio is then exactly 1 and the value clip is centred on values of
    the same precision."""
    ids, attention_mask, prompt_length, mask, texts, has_eos = generate_responses(models, rows, config)
    scores, metrics = score_responses(models, reward_fns, rewards, rows, texts, config.mini_batch_size)
    scores = scores.to(ids.device)
    if config.missing_eos_penalty is not None:
        scores = scores - config.missing_eos_penalty * (~has_eos).float()
    chunks = {"logprobs": [], "entropy": [], "ref": [], "values": []}
    with torch.no_grad(), accelerator.autocast():
        for start in range(0, len(rows), config.mini_batch_size):
            part = slice(start, start + config.mini_batch_size)
            args = (ids[part], attention_mask[part], prompt_length)
            logprobs, entropy = policy_logprobs(models, *args, config.temperature, with_entropy=True)
            chunks["logprobs"].append(logprobs)
            chunks["entropy"].append(entropy)
            chunks["ref"].append(reference_logprobs(models, *args, config.temperature))
            use_adapter(models, CRITIC)
            chunks["values"].append(response_values(models, *args).float())
    use_adapter(models, POLICY)
    rollout = Rollout(input_ids=ids, attention_mask=attention_mask, prompt_length=prompt_length, mask=mask,
                      logprobs=torch.cat(chunks["logprobs"]), ref_logprobs=torch.cat(chunks["ref"]),
                      values=torch.cat(chunks["values"]) * mask, scores=scores, entropy=torch.cat(chunks["entropy"]),
                      completions=texts, has_eos=has_eos)
    return rollout, metrics


def rollout_samples(rows, rollout: Rollout) -> list[dict[str, Any]]:
    """A few (prompt, response, score) triples for the dashboard and completions.jsonl."""
    samples = []
    for row, completion, score in list(zip(rows, rollout.completions, rollout.scores.tolist()))[:3]:
        prompt = row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else str(row["prompt"])
        samples.append({"prompt": prompt, "completion": completion, "reward": score})
    return samples


def evaluate_held_out(models: PPOModels, rows, reward_fns, rewards, config: PPOConfig) -> dict[str, float]:
    """Greedy responses to the held-out prompts: mean score, and exact match where rows have an `answer`."""
    from kitcli.models.generate import exact_match, generate

    use_adapter(models, POLICY)
    completions = generate(models.model, models.tokenizer, [r["prompt"] for r in rows],
                           max_new_tokens=config.response_length, batch_size=max(config.mini_batch_size, 16),
                           temperature=0.0, seed=config.seed)
    scores, per_source = score_responses(models, reward_fns, rewards, rows, completions, config.mini_batch_size)
    figures = {"eval/score": float(scores.mean()), **{f"eval/{k}": v for k, v in per_source.items()}}
    if "answer" in rows[0]:
        figures["eval/exact_match"] = sum(exact_match(c, r["answer"]) for c, r in zip(completions, rows)) / len(rows)
    return figures
