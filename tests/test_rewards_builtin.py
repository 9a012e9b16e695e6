"""Each built-in reward on a table of cases, edge cases included: no answer tag, several answers, whitespace,
unicode, empty completion; standard (string) and conversational (message list) completions alike."""

from __future__ import annotations

import doctest

import pytest

import rewards.builtin as builtin
import rewards.text as text
from kitcli.errors import KitError
from rewards.builtin import (
    code_exec,
    exact_match,
    format,
    length_penalty,
    math_equal,
    overlong_penalty,
    repetition_penalty,
    tag_credit,
)


def conversational(completion: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": completion}]


def score(fn, completion, **columns):
    """The score of one completion, checked to be the same in the standard and the conversational format."""
    single = {k: [v] for k, v in columns.items()}
    standard = fn(["prompt"], [completion], **single)
    chat = fn([[{"role": "user", "content": "prompt"}]], [conversational(completion)], **single)
    assert standard == chat, (completion, standard, chat)
    assert len(standard) == 1
    return standard[0]


def test_docstring_examples_run():
    for module in (builtin, text):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{module.__name__}: {result.failed} docstring examples failed"


@pytest.mark.parametrize("completion, answer, expected", [
    ("<answer>8</answer>", "8", 1.0),
    ("<think>3 + 5</think><answer>8</answer>", "8", 1.0),
    ("8", "8", 1.0),                                      # no answer tag: the whole completion
    ("The answer is 8", "8", 0.0),                        # no tag and more than the answer
    ("<answer>7</answer> <answer>8</answer>", "8", 1.0),  # several answers: the last one counts
    ("<answer>8</answer> <answer>7</answer>", "8", 0.0),
    ("<answer>  8 \n</answer>", "8", 1.0),                # whitespace
    ("  8.  ", "8", 1.0),                                 # a final period
    ("<answer>New  York</answer>", "new york", 1.0),      # case and inner spacing
    ("<answer>８</answer>", "8", 1.0),                    # full-width digit (NFKC)
    ("<answer>café</answer>", "cafe\u0301", 1.0),         # composed vs decomposed accent
    ("<answer>日本</answer>", "日本", 1.0),
    ("", "8", 0.0),                                       # empty completion
    ("<answer></answer>", "8", 0.0),
    ("<answer>8", "8", 0.0),                              # unclosed tag: not an answer tag
    (r"so \boxed{8}", "8", 1.0),
    ("<answer>9</answer>", ["8", "9"], 1.0),              # a list of accepted answers
])
def test_exact_match(completion, answer, expected):
    assert score(exact_match, completion, answer=answer) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("<answer>0.5</answer>", "1/2", 1.0),
    ("<answer>1/2</answer>", "0.5", 1.0),
    (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    ("<answer>3.0</answer>", "3", 1.0),
    ("<answer>8</answer>", "8", 1.0),
    ("8", "8", 1.0),                                      # no answer tag: parsed from the whole text
    ("<answer>7</answer><answer>8</answer>", "8", 1.0),   # several answers: the last tag
    ("<answer>\n  8  \n</answer>", "8", 1.0),
    ("<answer>８</answer>", "8", 1.0),                    # full-width digit
    ("<answer>√2</answer>", r"\sqrt{2}", 1.0),           # unicode root vs LaTeX
    (r"<answer>\sqrt{2}</answer>", r"\sqrt{2}", 1.0),
    ("<answer>−3</answer>", "-3", 1.0),                   # unicode minus
    ("", "8", 0.0),
    ("<answer>eight</answer>", "8", 0.0),
])
def test_math_equal(completion, answer, expected):
    assert score(math_equal, completion, answer=answer) == expected


def test_math_equal_unparseable_gold_is_no_score():
    assert math_equal(["q"], ["<answer>8</answer>"], answer=["not math at all ???"]) == [None]


FORMAT_CASES = [
    # completion, soft, strict, tag credit
    ("<think>3 + 5</think><answer>8</answer>", 1.0, 1.0, 1.0),
    ("<think>3 + 5</think>\n\n<answer>8</answer>\n", 1.0, 1.0, 1.0),
    ("  <think>\n3 + 5\n</think>\n<answer>\n8\n</answer>  ", 1.0, 1.0, 1.0),  # whitespace around and between
    ("Sure! <think>a</think> so <answer>8</answer> done", 1.0, 0.0, 1.0),     # text outside the tags
    ("<answer>8</answer><think>a</think>", 0.0, 0.0, 1.0),                     # wrong order
    ("<think>a</think>", 0.0, 0.0, 0.5),                                       # no answer tag
    ("<answer>8</answer>", 0.0, 0.0, 0.5),
    ("<think>a</think><answer>7</answer><answer>8</answer>", 1.0, 0.0, 0.5),   # several answers
    ("<think>a</think><answer>8", 0.0, 0.0, 0.75),                             # unclosed answer
    ("<think>ü → ∑</think><answer>日本</answer>", 1.0, 1.0, 1.0),             # unicode
    ("", 0.0, 0.0, 0.0),                                                       # empty completion
    ("think answer", 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize("completion, soft, strict, credit", FORMAT_CASES)
def test_format_soft_strict_and_tag_credit(completion, soft, strict, credit):
    assert score(format(), completion) == soft
    assert score(format(strict=True), completion) == strict
    assert score(tag_credit(), completion) == credit


def test_format_tags_are_configurable_and_named():
    reasoning = format(tags=["reasoning", "final"], strict=True)
    assert reasoning.__name__ == "format_strict_reasoning_final"
    assert score(reasoning, "<reasoning>x</reasoning> <final>1</final>") == 1.0
    assert score(reasoning, "<think>x</think> <answer>1</answer>") == 0.0
    assert format(tags=["answer"]).__name__ == "format_answer"
    assert score(tag_credit(tags=["a", "b", "c", "d"]), "<a></a><b></b>") == 0.5
    assert tag_credit(tags=["answer"]).__name__ == "tag_credit_answer"


@pytest.mark.parametrize("tags", [[], "", ["<think>"], [1], None])
def test_format_rejects_bad_tags(tags):
    with pytest.raises(KitError, match="tag"):
        format(tags=tags)


@pytest.mark.parametrize("length, expected", [(0, 0.0), (4, 0.0), (7, -0.5), (10, -1.0), (50, -1.0)])
def test_length_penalty_in_tokens(length, expected):
    reward = length_penalty(max_length=10, target=4)
    assert reward(["q"], ["x"], completion_ids=[[1] * length]) == [expected]


def test_length_penalty_counts_characters_without_token_ids():
    reward = length_penalty(max_length=10, max_penalty=-2.0)
    assert score(reward, "") == 0.0
    assert score(reward, "abcde") == -1.0
    assert score(reward, "ü" * 20) == -2.0  # characters, not bytes


@pytest.mark.parametrize("length, expected", [(0, 0.0), (80, 0.0), (90, -0.5), (100, -1.0), (101, -1.0)])
def test_overlong_penalty(length, expected):
    reward = overlong_penalty(max_length=100, cache=20)
    assert reward(["q"], ["x"], completion_ids=[[1] * length]) == [expected]


@pytest.mark.parametrize("completion, expected", [
    ("the cat sat on the mat", 0.0),
    ("go go go go go", -0.75),          # 4 bigrams, 1 distinct
    ("Go go GO go", -2 / 3),            # case-insensitive
    ("go   go\n\tgo", -0.5),            # whitespace-separated words
    ("ü ü ü", -0.5),
    ("one", 0.0),                       # fewer words than the n-gram size
    ("", 0.0),
])
def test_repetition_penalty(completion, expected):
    assert score(repetition_penalty(ngram=2), completion) == pytest.approx(expected)


@pytest.mark.parametrize("factory, args", [
    (length_penalty, {"max_length": 0}), (length_penalty, {"max_length": 10, "target": 10}),
    (length_penalty, {"max_length": 10, "max_penalty": 1}), (overlong_penalty, {"max_length": 10, "cache": 0}),
    (overlong_penalty, {"max_length": 10, "cache": 11}), (repetition_penalty, {"ngram": 0}),
    (code_exec, {"time_limit": 0}), (code_exec, {"memory_mb": -1}),
])
def test_factories_reject_bad_arguments(factory, args):
    with pytest.raises(KitError):
        factory(**args)


CODE = "```python\ndef double(x):\n    return 2 * x\n```"
CODE_CASES = [
    (CODE, ["assert double(2) == 4", "assert double(0) == 0"], 1.0),
    (CODE, ["assert double(2) == 4", "assert double(3) == 7"], 0.5),
    ("def double(x):\n    return 2 * x", "assert double(2) == 4", 1.0),              # no fence; one test as a string
    ("text\n```\ndef double(x): return x\n```\nthen\n```python\ndef double(x): return 2*x\n```",
     '["assert double(5) == 10"]', 1.0),                                              # last python block; JSON tests
    ("```python\nprint(int(input()) * 2)\n```", [{"input": "21\n", "output": "42\n"}], 1.0),   # stdin/stdout
    ("```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\n```",
     {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "8\n"]}, 0.5),                # APPS-style mapping
    ("```python\nprint('ünïcödé ✓')\n```", [{"input": "", "output": "ünïcödé ✓"}], 1.0),
    ("", ["assert double(2) == 4"], 0.0),                                             # empty completion
    ("```python\ndef double(x:\n```", ["assert True"], 0.0),                          # syntax error
    ("```python\nraise SystemExit(0)\n```", ["assert True"], 0.0),                    # exiting early is no pass
]


@pytest.mark.parametrize("completion, tests, expected", CODE_CASES)
def test_code_exec(completion, tests, expected):
    assert score(code_exec(time_limit=3), completion, tests=tests) == expected


def test_code_exec_all_or_nothing_and_missing_tests():
    reward = code_exec(time_limit=3, partial=False)
    assert reward(["q"] * 2, [CODE] * 2, tests=[["assert double(2) == 4", "assert double(3) == 7"], []]) == [0.0, None]
    with pytest.raises(KeyError, match="needs a 'tests' column"):
        reward(["q"], [CODE], answer=["4"])
    assert code_exec(tests_column="checks").required_columns == ["checks"]
