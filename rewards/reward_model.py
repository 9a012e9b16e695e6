"""Score prompt + completion with a sequence-classification reward model (loaded on first use, kept in memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kitcli.errors import KitError


def load_scorer(model_dir: Path, dtype=None):
    """(model, tokenizer) of a saved sequence-classification model with one output (a reward stage's merged/),
    frozen, in eval mode, on the GPU when there is one, with the pad token set so the last real token is scored.
    `dtype` (a torch dtype): by default bfloat16 (or float16) on a GPU, float32 on a CPU."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if dtype is None:
        dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if torch.cuda.is_available() \
            else torch.float32
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    if model.config.num_labels != 1:
        raise KitError(f"reward model '{model_dir}' has {model.config.num_labels} outputs; a reward model has one")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    if torch.cuda.is_available():
        model.to("cuda")
    model.eval().requires_grad_(False)
    return model, tokenizer


class RewardModelScorer:
    def __init__(self, model_dir: Path, *, batch_size: int = 8, max_length: int = 1024, stage: str | None = None):
        self.model_dir = Path(model_dir)
        self.batch_size = batch_size
        self.max_length = max_length
        self.stage = stage
        self.loaded = None

    def load(self):
        if self.loaded is None:
            if not (self.model_dir / "config.json").is_file():
                hint = (f"run the reward stage '{self.stage}' first" if self.stage
                        else "give a directory written by a reward stage (<run>/<stage>/merged)")
                raise KitError(f"reward_model: no model at {self.model_dir} (config.json missing); {hint}")
            self.loaded = load_scorer(self.model_dir)
        return self.loaded

    def texts(self, tokenizer, prompts: list[Any], completions: list[Any]) -> list[str]:
        """What the reward stage scored: the chat template over prompt + completion messages, or the two strings
        joined for standard rows."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list):
                reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
                out.append(tokenizer.apply_chat_template(list(prompt) + list(reply), tokenize=False))
            else:
                reply = "".join(m.get("content", "") for m in completion) if isinstance(completion, list) \
                    else str(completion)
                out.append(str(prompt) + reply)
        return out

    def score(self, prompts: list[Any], completions: list[Any]) -> list[float]:
        import torch

        model, tokenizer = self.load()
        texts = self.texts(tokenizer, prompts, completions)
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                  padding_side="right", truncation=True, max_length=self.max_length,
                                  add_special_tokens=False).to(model.device)
                logits = model(**batch).logits
                scores += [float(v) for v in logits[:, 0].float().cpu()]
        return scores
