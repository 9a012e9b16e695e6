"""Built-in rewards. Each is registered under its name in the `kit.rewards` entry-point group (this package's
pyproject), the same way a third-party package registers its own; `kit rewards list` shows them.

Every reward takes `(prompts, completions, **columns)` and returns one float (or None: "no score") per
completion; completions are strings or, for conversational data, lists of messages, as TRL passes them.
Plain functions take no arguments; factories (`@reward_factory`) take the recipe's `args:` and return one.
Each declares the range of its scores (`@score_range`, or `score_range` on what a factory returns); the guard
stops training when a score falls outside it.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from pathlib import Path
from typing import Any

from kitcli.errors import KitError
from rewards.registry import reward_factory, score_range
from rewards.reward_args import check_tags, non_positive, positive_int
from rewards.text import (
    completion_lengths,
    completion_text,
    extract_answer,
    extract_code,
    judge_touches,
    normalize_answer,
    normalize_unicode,
    quiet_math_verify,
    tagged,
)

log = logging.getLogger("rewards")


# --- answers ----------------------------------------------------------------------------------------------------

@score_range(0, 1)
def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
    r"""1.0 when the completion's final answer equals the row's `answer` column.

    `answer` is a string, or a list of accepted ones. The final answer is the last `<answer>...</answer>`,
    else the last `\boxed{...}`, else the whole completion; both sides are compared up to case, spacing, a
    final period and Unicode compatibility forms (full-width digits).

    >>> completions = ["<answer>4</answer>", "<answer>3</answer> <answer>４</answer>", "5"]
    >>> exact_match(["2+2="] * 3, completions, answer=["4"] * 3)
    [1.0, 1.0, 0.0]
    """
    scores = []
    for completion, expected in zip(completions, answer):
        accepted = expected if isinstance(expected, (list, tuple)) else [expected]
        given = normalize_answer(extract_answer(completion_text(completion)))
        scores.append(float(any(given == normalize_answer(a) for a in accepted if a is not None)))
    return scores


@score_range(0, 1)
def math_equal(prompts, completions, answer, **kwargs) -> list[float | None]:
    r"""1.0 when the final answer equals the row's `answer` mathematically (math-verify).

    The final answer is the last `<answer>` tag's content, else the whole completion: `1/2` equals `0.5` and
    `\frac{1}{2}`, `\boxed{}` answers are found, `3.0` equals `3`, `√2` equals `\sqrt{2}`. None (no score)
    when the row's answer itself cannot be parsed.

    >>> completions = [r"so \boxed{\frac{1}{2}}", "<answer>0.5</answer>", "1/3"]
    >>> math_equal(["half?"] * 3, completions, answer=["1/2"] * 3)
    [1.0, 1.0, 0.0]
    """
    from math_verify import parse, verify

    # math-verify times out through signal.alarm, which works only in the main thread
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    quiet_math_verify(timeout)

    def parsed(text: str):
        found = parse(text, parsing_timeout=timeout)
        if not found and "\\" in text and "$" not in text:  # bare LaTeX such as \sqrt{2}: read it as math
            found = parse(f"${text}$", parsing_timeout=timeout)
        return found if any(not isinstance(item, str) for item in found) else []

    scores: list[float | None] = []
    for completion, expected in zip(completions, answer):
        gold = parsed(normalize_unicode(str(expected)))
        if not gold:
            scores.append(None)
            continue
        text = normalize_unicode(completion_text(completion))
        found = tagged(text, "answer")
        guess = parsed(found[-1].strip()) if found else parsed(text)
        scores.append(float(bool(guess) and verify(gold, guess, timeout_seconds=timeout)))
    return scores


NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?$")


@score_range(0, 1)
@reward_factory
def numeric_closeness(scale: float = 1.0):
    """Partial credit for a numeric answer near the row's `answer`: 1 / (1 + |given - expected| / scale).

    1.0 for the right number, 0.5 one `scale` away, falling towards 0; 0.0 when the final answer (as exact_match
    finds it) is not a plain number. A dense signal beside exact_match for arithmetic, where a near miss is
    common: groups whose samples are all wrong still rank them. None when the row's answer is not a number.

    >>> numeric_closeness(scale=2.0)(["q"] * 4, ["10", "<answer>12</answer>", "ten", "8.5"], answer=["10"] * 4)
    [1.0, 0.5, 0.0, 0.5714285714285714]
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise KitError(f"scale must be a number > 0, got {scale!r}")

    def numeric_closeness_reward(prompts, completions, answer, **kwargs) -> list[float | None]:
        scores: list[float | None] = []
        for completion, expected in zip(completions, answer):
            gold = normalize_answer(expected).replace(",", "")
            if not NUMBER.match(gold):
                scores.append(None)
                continue
            given = normalize_answer(extract_answer(completion_text(completion))).replace(",", "")
            scores.append(1.0 / (1.0 + abs(float(given) - float(gold)) / scale) if NUMBER.match(given) else 0.0)
        return scores

    numeric_closeness_reward.__name__ = "numeric_closeness"
    return numeric_closeness_reward


# --- format -----------------------------------------------------------------------------------------------------

@score_range(0, 1)
@reward_factory
def format(tags: list[str] = ("think", "answer"), strict: bool = False):  # noqa: A001
    """1.0 when the completion has the tags in order (soft), or is exactly them (strict).

    Soft (default): each `<tag>...</tag>` appears, in order,
    with anything around them. Strict: the completion is exactly the tags in order, each once, with only
    whitespace between and around them.

    >>> format(tags=["think", "answer"])(["q"], ["<think>2+2</think> so <answer>4</answer>", "<answer>4</answer>"])
    [1.0, 0.0]
    >>> format(strict=True)(["q"], ["<think>2+2</think>\\n<answer>4</answer>", "hi <think>a</think><answer>4</answer>"])
    [1.0, 0.0]
    """
    tags = check_tags(tags)
    pairs = [rf"<{re.escape(t)}>.*?</{re.escape(t)}>" for t in tags]
    strict_pattern = re.compile(r"\s*" + r"\s*".join(pairs) + r"\s*", re.DOTALL)
    soft_pattern = re.compile(r".*?".join(pairs), re.DOTALL)

    def score(text: str) -> float:
        if not strict:
            return float(bool(soft_pattern.search(text)))
        once = all(text.count(f"<{t}>") == 1 and text.count(f"</{t}>") == 1 for t in tags)
        return float(once and bool(strict_pattern.fullmatch(text)))

    def format_reward(prompts, completions, **kwargs) -> list[float]:
        return [score(completion_text(c)) for c in completions]

    format_reward.__name__ = f"format_{'strict_' if strict else ''}{'_'.join(tags)}"
    format_reward.__doc__ = f"{'strict' if strict else 'soft'} format: {' then '.join(f'<{t}>' for t in tags)}"
    return format_reward


@score_range(0, 1)
@reward_factory
def tag_credit(tags: list[str] = ("think", "answer")):
    """Partial credit for each reasoning/answer tag that appears exactly once.

    Each opening and each closing tag that appears exactly once earns
    1 / (2 x number of tags), so a completion with every tag once scores 1.0 and each missing or repeated tag
    costs its share. A smoother signal than `format` early in training.

    >>> tag_credit(tags=["think", "answer"])(["q"], ["<think>a</think><answer>4</answer>", "<think>a</think> 4"])
    [1.0, 0.5]
    """
    tags = check_tags(tags)
    share = 1.0 / (2 * len(tags))

    def tag_credit_reward(prompts, completions, **kwargs) -> list[float]:
        scores = []
        for completion in completions:
            text = completion_text(completion)
            hits = sum((text.count(f"<{t}>") == 1) + (text.count(f"</{t}>") == 1) for t in tags)
            scores.append(round(hits * share, 6))
        return scores

    tag_credit_reward.__name__ = f"tag_credit_{'_'.join(tags)}"
    return tag_credit_reward


# --- length and repetition --------------------------------------------------------------------------------------

@reward_factory
def length_penalty(max_length: int, target: int = 0, max_penalty: float = -1.0):
    """A penalty growing linearly with length past a target, down to max_penalty.

    0 up to `target`, then falling linearly to `max_penalty` at `max_length` and staying there: shorter is
    better past the target. Lengths are in tokens when the trainer passes completion_ids (training, `kit rewards
    preview`), else in characters.

    >>> length_penalty(max_length=10, target=4)(["q"] * 3, ["a", "b", "c"], completion_ids=[[1] * 2, [1] * 7, [1] * 20])
    [0.0, -0.5, -1.0]
    """
    max_length = positive_int(max_length, "max_length")
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < max_length:
        raise KitError(f"target must be an integer from 0 to below max_length ({max_length}), got {target!r}")
    max_penalty = non_positive(max_penalty, "max_penalty")

    def length_penalty_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
        lengths, _ = completion_lengths(completions, completion_ids)
        return [max_penalty * min(max(n - target, 0) / (max_length - target), 1.0) + 0.0 for n in lengths]

    length_penalty_reward.__name__ = "length_penalty"
    length_penalty_reward.score_range = (max_penalty, 0.0)
    return length_penalty_reward


@score_range(-1, 0)
@reward_factory
def overlong_penalty(max_length: int, cache: int):
    """DAPO's soft overlong punishment: 0, then down to -1 near and past max_length.

    Eq. 13 of the DAPO paper: 0 up to `max_length - cache`, then falling linearly to -1 at
    `max_length`, and -1 beyond (a truncated completion). Set `max_length` to the stage's max_completion_length.
    Lengths are in tokens when completion_ids are passed, else in characters.

    >>> reward = overlong_penalty(max_length=100, cache=20)
    >>> reward(["q"] * 3, ["a", "b", "c"], completion_ids=[[1] * 80, [1] * 90, [1] * 101])
    [0.0, -0.5, -1.0]
    """
    max_length = positive_int(max_length, "max_length")
    if isinstance(cache, bool) or not isinstance(cache, int) or not 0 < cache <= max_length:
        raise KitError(f"cache must be an integer from 1 to max_length ({max_length}), got {cache!r}")
    start = max_length - cache

    def overlong_penalty_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
        lengths, _ = completion_lengths(completions, completion_ids)
        return [0.0 if n <= start else (start - n) / cache if n <= max_length else -1.0 for n in lengths]

    overlong_penalty_reward.__name__ = "overlong_penalty"
    return overlong_penalty_reward


@reward_factory
def repetition_penalty(ngram: int = 3, max_penalty: float = -1.0):
    """A penalty for repeated word n-grams (0: none repeated, max_penalty: a loop).

    The share of repeated word n-grams times `max_penalty`. Words are whitespace-separated and compared
    case-insensitively; a completion with fewer than `ngram` words scores 0.

    >>> repetition_penalty(ngram=2)(["q"] * 2, ["the cat sat on the mat", "go go go go go"])
    [0.0, -0.75]
    """
    ngram = positive_int(ngram, "ngram")
    max_penalty = non_positive(max_penalty, "max_penalty")

    def repetition_penalty_reward(prompts, completions, **kwargs) -> list[float]:
        scores = []
        for completion in completions:
            words = completion_text(completion).casefold().split()
            grams = [tuple(words[i:i + ngram]) for i in range(len(words) - ngram + 1)]
            repeated = 1 - len(set(grams)) / len(grams) if grams else 0.0
            scores.append(max_penalty * repeated if repeated else 0.0)
        return scores

    repetition_penalty_reward.__name__ = "repetition_penalty"
    repetition_penalty_reward.score_range = (max_penalty, 0.0)
    return repetition_penalty_reward


# --- learned reward model ---------------------------------------------------------------------------------------

@score_range(-math.inf, math.inf)  # a learned score: any finite number
@reward_factory
def reward_model(path: str | None = None, stage: str | None = None, batch_size: int = 8, max_length: int = 1024,
                 *, base_dir: Path | None = None, run_dir: Path | None = None):
    """The score a reward model (a reward stage's output, or a path) gives prompt + completion.

    A sequence-classification model with one output scores the chat template over prompt + completion for
    conversational rows, the two strings joined otherwise. `stage: NAME` uses `<run>/<NAME>/merged` (a reward
    stage's output in this run); `path:` any such model directory (relative to the recipe). Loaded on first
    use, on the GPU when there is one.

    >>> rm = reward_model(path="runs/demo/rm/merged")  # doctest: +SKIP
    >>> rm(["Ada has 3 apples and gets 5 more. How many?"], ["8"])  # doctest: +SKIP
    [1.73]
    """
    from rewards.reward_model import RewardModelScorer

    if (path is None) == (stage is None):
        raise KitError("reward_model needs exactly one of path: (a model directory) or stage: (a reward stage "
                       "of this recipe)")
    if stage is not None:
        if run_dir is None:
            raise KitError(f"reward_model stage: '{stage}' needs the run directory, which is not known here; give "
                           f"path: <run>/{stage}/merged instead (or pass --run-dir)")
        from kitcli.rundir import RunDir

        model_dir = RunDir(Path(run_dir)).stage(str(stage)).merged
    else:
        model_dir = Path(str(path)).expanduser()
        if not model_dir.is_absolute() and base_dir is not None:
            model_dir = Path(base_dir) / model_dir
        if not model_dir.is_dir():
            raise KitError(f"reward_model path '{path}' is not a directory (looked at {model_dir}); give a "
                           f"sequence-classification model directory such as <run>/<reward stage>/merged")
    scorer = RewardModelScorer(model_dir, batch_size=positive_int(batch_size, "batch_size"),
                               max_length=positive_int(max_length, "max_length"), stage=stage)

    def reward_model_reward(prompts, completions, **kwargs) -> list[float]:
        return scorer.score(prompts, completions)

    reward_model_reward.__name__ = f"reward_model_{stage}" if stage else "reward_model"
    return reward_model_reward


# --- code execution ---------------------------------------------------------------------------------------------

@score_range(0, 1)
@reward_factory
def code_exec(tests_column: str = "tests", time_limit: float = 5.0, memory_mb: int = 512, partial: bool = True,
              workers: int = 2, network: bool = False):
    """Share of the row's test cases that the completion's code passes, run in a sandbox and judged outside it.

    Runs the completion's code (its last ```python block, else the whole text) in a sandbox: a separate process
    with a time limit, a memory limit, no network where the OS allows it, in a temporary directory (see
    rewards/sandbox.py). The sandbox only computes: the values an assertion needs, the output a program prints.
    Every verdict is made in this process, on plain data, against expected values the sandbox never sees. Scores
    the share of tests passed (`partial: false`: 1.0 only when all pass). A hang, crash, memory hog or fork bomb
    fails the tests it had not passed, is logged, and never stops training.

    Test cases (column `tests` by default): assert statements (after optional imports), or stdin/stdout pairs
    `{input: "2\\n", output: "4\\n"}`; a list, one item, or a JSON string of either. No test cases: None. A test
    case the judge cannot split (docs/rewards.md) is refused when the data is read.

    >>> reward = code_exec(time_limit=2)
    >>> reward(["double"], ["```python\\ndef f(x):\\n    return 2 * x\\n```"], tests=[["assert f(2) == 4"]])
    [1.0]
    """
    from rewards.judge import parse_tests
    from rewards.sandbox import SandboxLimits, run_batch

    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not 0 < time_limit <= 600:
        raise KitError(f"time_limit must be a number of seconds from 0 to 600, got {time_limit!r}")
    limits = SandboxLimits(time_limit=float(time_limit), memory_mb=positive_int(memory_mb, "memory_mb"),
                           network=bool(network))
    workers = positive_int(workers, "workers")

    def row_tests(value: Any, index: int):
        try:
            return parse_tests(value)
        except ValueError as problem:
            raise ValueError(f"row {index}, column {tests_column}: {problem}") from None

    def check_rows(rows: list[dict[str, Any]]) -> None:
        for index, row in enumerate(rows):
            row_tests(row.get(tests_column), index)

    def code_exec_reward(prompts, completions, **columns) -> list[float | None]:
        if tests_column not in columns:
            raise KeyError(f"code_exec needs a '{tests_column}' column with each row's test cases; the rows have "
                           f"{', '.join(sorted(k for k in columns if k not in TRAINER_KWARGS)) or 'none'}")
        cases = [row_tests(value, index) for index, value in enumerate(columns[tests_column])]
        codes = [extract_code(completion_text(c)) for c in completions]
        results = run_batch(codes, cases, limits, workers)
        touches = [judge_touches(code) for code in codes]
        for index, result in enumerate(results):
            if result.status in ("timeout", "memory", "crashed"):
                log.warning("code_exec: sample %d %s after %.2fs (%s); its unpassed tests fail", index,
                            result.status, result.seconds, result.detail)
        if callable(columns.get("log_extra")):
            columns["log_extra"]("code_exec", [f"{r.status} {r.passed}/{r.total}" + (
                f" touches {', '.join(t)}" if t else "") for r, t in zip(results, touches)])
        total = sum(r.total for r in results)
        if callable(columns.get("log_metric")) and total:
            columns["log_metric"]("code_exec/tests_passed", sum(r.passed for r in results) / total)
            columns["log_metric"]("code_exec/judge_touches", sum(bool(t) for t in touches) / len(touches))
        return [None if r.status == "no_tests" else r.score(partial) for r in results]

    code_exec_reward.__name__ = "code_exec"
    code_exec_reward.required_columns = [tests_column]
    code_exec_reward.check_rows = check_rows
    code_exec_reward.score_range = (0.0, 1.0)
    return code_exec_reward


TRAINER_KWARGS = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
