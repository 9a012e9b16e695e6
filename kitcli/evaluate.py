"""Generation and exact-match scoring shared by eval stages (and, later, reward previews)."""

from __future__ import annotations

import re
from typing import Any

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str:
    """The content of the last <answer>...</answer> tag if there is one, else the whole text, stripped."""
    tagged = ANSWER_TAG.findall(text)
    return (tagged[-1] if tagged else text).strip()


def normalize(text: str) -> str:
    return " ".join(str(text).split()).rstrip(".").lower()


def exact_match(completion: str, answer: Any) -> bool:
    return normalize(extract_answer(completion)) == normalize(answer)


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
