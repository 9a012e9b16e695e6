"""Your own rewards for a recipe: plain functions, and a factory for a parametrized one.

A reward takes the batch's prompts and completions, plus any dataset column by name, and returns one float per
completion (or None: "no score for this sample"). TRL's GRPOTrainer calls it with keyword arguments:
    prompts      the prompts, strings or lists of messages (conversational data)
    completions  the completions, strings or [{"role": "assistant", "content": ...}] (conversational data)
    <column>     each other dataset column, one value per completion (e.g. answer)
    completion_ids, trainer_state, log_extra, log_metric   also passed; take **kwargs to accept them
The metrics log each reward under its `__name__`, so give every reward a stable, distinct one.

Use them in a recipe (paths are relative to the recipe file):

    rewards:
      - name: examples/my_rewards.py:ends_with_answer
      - name: examples/my_rewards.py:mentions
        args: {words: [apples, coins]}
        weight: 0.5
        on_error: skip       # a sample whose reward raises scores None instead of stopping the run

Check them before training:

    kit rewards test examples/my_rewards.py:ends_with_answer --data examples/my_rewards_samples.jsonl
    kit rewards test examples/my_rewards.py:mentions --arg words=[apples] --data examples/my_rewards_samples.jsonl
    python examples/my_rewards.py
"""

from __future__ import annotations

import re

from rewards.registry import reward_factory
from rewards.text import completion_text


def ends_with_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number in the completion is the row's answer, 0.5 when it appears earlier, else 0."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion_text(completion))
        if numbers and numbers[-1] == str(expected).strip():
            scores.append(1.0)
        elif str(expected).strip() in numbers:
            scores.append(0.5)
        else:
            scores.append(0.0)
    return scores


@reward_factory
def mentions(words: list[str], per_word: float = 1.0):
    """A factory: the recipe's `args:` are its arguments; it returns the reward."""
    wanted = [w.lower() for w in words]

    def mentions_reward(prompts, completions, **kwargs) -> list[float]:
        texts = [completion_text(c).lower() for c in completions]
        return [per_word * sum(w in text for w in wanted) / len(wanted) for text in texts]

    mentions_reward.__name__ = f"mentions_{'_'.join(wanted)}"  # a stable name: metrics are logged under it
    return mentions_reward


if __name__ == "__main__":
    prompts = ["Ada has 3 apples and gets 5 more. How many apples does Ada have?"] * 3
    completions = ["3 + 5 = 8", "8 apples, or 9", "She has 7 apples."]
    print("ends_with_answer", ends_with_answer(prompts, completions, answer=["8"] * 3))
    print("mentions", mentions(words=["apples"])(prompts, completions))
