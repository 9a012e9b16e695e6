"""Score prompt + completion with a sequence-classification reward model (loaded on first use, kept in memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kitcli.errors import KitError


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
            import torch

            from kitcli.backend import load_reward_model

            with torch.random.fork_rng():  # the loader seeds torch; keep the trainer's random stream as it was
                loaded = load_reward_model(str(self.model_dir), max_seq_length=self.max_length, load_in_4bit=False,
                                           lora=None, log=lambda message: None, label="reward model")
            if torch.cuda.is_available() and loaded.model.device.type == "cpu":
                loaded.model.to("cuda")  # the transformers fallback loads on the CPU
            loaded.model.eval()
            self.loaded = loaded
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

        loaded = self.load()
        model, tokenizer = loaded.model, loaded.tokenizer
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
