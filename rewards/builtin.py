"""Built-in rewards. Each is registered under its name in the `kit.rewards` entry-point group (pyproject)."""

from __future__ import annotations

import re
from typing import Any

from rewards.registry import reward_factory


def completion_text(completion: Any) -> str:
    """Text of a completion: a string (standard format) or a list of messages (conversational)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def extract_answer(text: str, tag: str = "answer") -> str:
    """The content of the last <tag>...</tag>, else the whole text, stripped."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return (found[-1] if found else text).strip()


def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer (the <answer> tag if any, else the text) equals the row's answer.

    >>> exact_match(["2+2="], ["<answer>4</answer>"], answer=["4"])
    [1.0]
    """
    return [float(" ".join(extract_answer(completion_text(c)).split()) == " ".join(str(a).split()))
            for c, a in zip(completions, answer)]


@reward_factory
def format(tags: tuple[str, ...] | list[str] = ("think", "answer"), strict: bool = False):  # noqa: A001
    """Partial credit per tag pair present (`<think>...</think>` etc.); strict requires the whole completion to be
    exactly the tags in order, separated only by whitespace.

    >>> format(tags=["answer"])(["q"], ["<answer>4</answer>"])
    [1.0]
    """
    tags = list(tags)
    pattern = re.compile(r"\s*" + r"\s*".join(rf"<{t}>.*?</{t}>" for t in tags) + r"\s*", re.DOTALL)

    def format_reward(prompts, completions, **kwargs) -> list[float]:
        scores = []
        for completion in completions:
            text = completion_text(completion)
            if strict:
                scores.append(float(bool(pattern.fullmatch(text))))
            else:
                hits = sum(1 for t in tags if re.search(rf"<{t}>.*?</{t}>", text, re.DOTALL))
                scores.append(hits / len(tags))
        return scores

    format_reward.__name__ = f"format_{'strict_' if strict else ''}{'_'.join(tags)}"
    return format_reward
