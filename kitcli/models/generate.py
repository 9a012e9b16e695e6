"""Generation and exact-match scoring shared by eval stages, PPO's held-out figures and reward previews."""

from __future__ import annotations

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
             temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Completions for `prompts` (greedy when temperature is 0), decoded without special tokens."""
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
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return completions
