"""Reward functions in the shapes people publish and copy, written for this project's tests (not copied): the
notebook style of Unsloth's GRPO notebooks (reads `completion[0]["content"]`, takes `answer` by keyword, prints,
keeps a global counter), open-r1's `rewards.py` style (plain functions and `get_*` factories that return the
reward), and rewards that return None, ints and bools, as TRL's contract allows. kit must take each as it is
written: no decorator, no wrapper file. tests/test_rewards_published.py uses them beside TRL's own `trl.rewards`."""

from __future__ import annotations

import math
import re

# --- notebook style ------------------------------------------------------------------------------------------------

PRINTED_TIMES = 0  # a global counter, as the notebooks keep one to print every few steps
PRINT_EVERY_STEPS = 2


def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    global PRINTED_TIMES
    responses = [completion[0]["content"] for completion in completions]
    question = prompts[0][-1]["content"]
    extracted = [extract_xml_answer(r) for r in responses]
    if PRINTED_TIMES % PRINT_EVERY_STEPS == 0:
        print("-" * 20, f"Question:\n{question}", f"\nAnswer:\n{answer[0]}", f"\nResponse:\n{responses[0]}",
              f"\nExtracted:\n{extracted[0]}")
    PRINTED_TIMES += 1
    return [2.0 if r == a else 0.0 for r, a in zip(extracted, answer)]


def int_reward_func(completions, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    return [0.5 if extract_xml_answer(r).isdigit() else 0.0 for r in responses]


def soft_format_reward_func(completions, **kwargs) -> list[float]:
    pattern = r"<think>.*?</think>\s*<answer>.*?</answer>"
    responses = [completion[0]["content"] for completion in completions]
    return [0.5 if re.match(pattern, r, flags=re.DOTALL) else 0.0 for r in responses]


def count_xml(text: str) -> float:
    count = 0.0
    if text.count("<think>\n") == 1:
        count += 0.125
    if text.count("\n</think>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def xmlcount_reward_func(completions, **kwargs) -> list[float]:
    return [count_xml(completion[0]["content"]) for completion in completions]


# --- open-r1 style -------------------------------------------------------------------------------------------------

def tag_count_reward(completions, **kwargs) -> list[float]:
    """A quarter for each of the four tags present exactly once."""
    def count_tags(text: str) -> float:
        return sum(0.25 for tag in ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>") if text.count(tag) == 1)

    return [count_tags(completion[0]["content"]) for completion in completions]


def get_repetition_penalty_reward(ngram_size: int, max_penalty: float):
    """A factory: the reward it returns penalises repeated word n-grams (open-r1 computes it on the text)."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")

    def repetition_penalty_reward(completions, **kwargs) -> list[float]:
        rewards = []
        for completion in completions:
            words = completion[0]["content"].lower().split()
            if len(words) < ngram_size:
                rewards.append(0.0)
                continue
            ngrams = list(zip(*[words[i:] for i in range(ngram_size)]))
            rewards.append((1 - len(set(ngrams)) / len(ngrams)) * max_penalty)
        return rewards

    return repetition_penalty_reward


def get_cosine_scaled_reward(min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0, max_len: int = 1000):
    """A factory whose every argument has a default: named without args:, kit calls it with none."""
    def cosine_scaled_reward(completions, answer, **kwargs) -> list[float]:
        rewards = []
        for completion, gold in zip(completions, answer):
            content = completion[0]["content"]
            correct = content.strip() == str(gold)
            cosine = math.cos(min(len(content) / max_len, 1.0) * math.pi)
            low, high = (min_value_correct, max_value_correct) if correct else (max_value_wrong, min_value_wrong)
            rewards.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return rewards

    return cosine_scaled_reward


# --- what TRL's contract allows beside floats ----------------------------------------------------------------------

def starts_with_digit(completions, **kwargs) -> list[bool]:
    return [completion[0]["content"].strip()[:1].isdigit() for completion in completions]


def answer_length(completions, **kwargs) -> list[int]:
    return [len(completion[0]["content"]) for completion in completions]


def numeric_answers_only(completions, answer, **kwargs) -> list[float | None]:
    """Mixed data: rows whose answer is not a number are not this reward's to judge (None, "no score")."""
    return [float(c[0]["content"].strip() == a) if a.isdigit() else None for c, a in zip(completions, answer)]


def never_scores(completions, **kwargs) -> list[float | None]:
    """Like `trl.rewards.accuracy_reward` on rows whose gold answer it cannot parse: no score, ever."""
    return [None] * len(completions)
