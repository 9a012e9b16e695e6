"""Generation and exact-match scoring shared by eval stages, PPO's held-out figures and reward previews."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def exact_match(completion: str, answer: Any) -> bool:
    """The `exact_match` reward's verdict (rewards/builtin.py): the last <answer> tag's content (else the last
    \\boxed{}, else the whole text) equals the answer, or one of a list of accepted answers, up to case, spacing, a
    final period and Unicode compatibility forms. One definition for eval stages, PPO's held-out figures and the
    reward an RL stage trains on."""
    from rewards.builtin import exact_match as exact_match_reward

    return exact_match_reward([None], [completion], answer=[answer])[0] == 1.0


def prompt_text(tokenizer, prompt: Any) -> str:
    """A conversational prompt (list of messages) through the chat template; a plain string as it is."""
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return str(prompt)


def generate(model, tokenizer, prompts: list[Any], *, max_new_tokens: int, batch_size: int = 32,
             temperature: float = 0.0, seed: int = 0, on_batch: Callable[[int], None] | None = None) -> list[str]:
    """Completions for `prompts` (greedy when temperature is 0), decoded without special tokens; `on_batch` is told
    how many prompts each finished batch held (a progress bar)."""
    import torch

    texts = [prompt_text(tokenizer, p) for p in prompts]
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    torch.manual_seed(seed)
    completions: list[str] = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False).to(model.device)
            sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
            with torch.no_grad():
                output = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                        **sampling)
            new_tokens = output[:, batch["input_ids"].shape[1]:]
            completions += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            if on_batch is not None:
                on_batch(len(new_tokens))
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return completions


def stop_token_ids(model, tokenizer) -> set[int]:
    """The token ids a generation stops on: the generation config's EOS ids and the tokenizer's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def sample(model, tokenizer, prompts: list[Any], *, n: int, max_new_tokens: int, sampling: dict[str, Any],
           batch_size: int = 8, seed: int = 0) -> list[list[tuple[str, list[int], bool]]]:
    """`n` sampled completions of each prompt, as an RL trainer draws them: for each prompt a list of (text without
    special tokens, completion token ids up to and including the stop token, truncated: no stop token within
    max_new_tokens). `sampling` holds the sampling settings (temperature, top_p, top_k, min_p, repetition_penalty)
    of a fresh GenerationConfig, as TRL's trainer builds one. Each batch of prompts is seeded from `seed` and its
    first prompt's index, so a batch gives the same samples whether or not the batches before it ran here."""
    import torch
    from transformers import GenerationConfig

    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stops), 0)
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    # a fresh config, as TRL's GRPOTrainer builds one: the model's own generation defaults do not leak in
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=pad,
                              eos_token_id=sorted(stops), num_return_sequences=n, **sampling)
    groups: list[list[tuple[str, list[int], bool]]] = []
    try:
        for start in range(0, len(prompts), batch_size):
            torch.manual_seed(seed * 1_000_003 + start)
            texts = [prompt_text(tokenizer, p) for p in prompts[start:start + batch_size]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            with torch.no_grad():
                output = model.generate(**batch, generation_config=config)
            for row in range(len(texts)):
                group = []
                for new in output[row * n:(row + 1) * n, batch["input_ids"].shape[1]:].tolist():
                    end = next((i for i, t in enumerate(new) if t in stops), None)
                    ids = new if end is None else new[:end + 1]
                    group.append((tokenizer.decode(ids, skip_special_tokens=True), ids, end is None))
                groups.append(group)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return groups
