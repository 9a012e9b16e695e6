"""Text helpers shared by the built-in rewards: a completion's text, its final answer, its code block, and the
names in its code that reach for the judge around it (code_exec and the dashboard's alarm read them)."""

from __future__ import annotations

import logging
import re
import unicodedata
from typing import Any

CODE_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def completion_text(completion: Any) -> str:
    """Text of a completion: a string (standard format) or a list of messages (conversational, as TRL passes).

    A multi-turn completion with tool turns (TRL's GRPO with tools: assistant, tool, assistant, ...) is scored on its
    final answer, the content of its last assistant turn; one that ends on a tool turn (cut off before the model
    answered) has none. A tool's output is never read as the model's answer."""
    if isinstance(completion, list):
        messages = [m for m in completion if isinstance(m, dict)]
        if any(m.get("role") == "tool" for m in messages):
            last = messages[-1]
            return str(last.get("content") or "") if last.get("role") == "assistant" else ""
        return "".join(str(m.get("content") or "") for m in messages)
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return "" if completion is None else str(completion)


def prompt_text(prompt: Any) -> str:
    """Text of a prompt: a string, or the messages' contents joined by newlines."""
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content") or "") for m in prompt if isinstance(m, dict))
    return "" if prompt is None else str(prompt)


def tagged(text: str, tag: str) -> list[str]:
    """The contents of every complete `<tag>...</tag>` in `text`, in order."""
    return re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index]
    return None


def extract_answer(text: str, tag: str = "answer") -> str:
    r"""The final answer: the last `<tag>...</tag>`, else the last `\boxed{...}`, else the whole text; stripped.

    >>> extract_answer("<think>2+2</think><answer> 4 </answer>")
    '4'
    >>> extract_answer(r"so \boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
    """
    found = tagged(text, tag)
    if found:
        return found[-1].strip()
    boxed = last_boxed(text)
    return (boxed if boxed is not None else text).strip()


def normalize_answer(text: Any) -> str:
    """Compare answers up to Unicode compatibility forms (full-width digits), case, spacing and a final period."""
    text = unicodedata.normalize("NFKC", str(text))
    return " ".join(text.split()).rstrip(".").strip().casefold()


def extract_code(text: str) -> str:
    """The last fenced code block (```python ... ```) of a completion, else the whole text."""
    blocks = CODE_BLOCK.findall(text)
    if not blocks:
        return text
    python = [body for language, body in blocks if language.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def completion_lengths(completions: list[Any], completion_ids: list[list[int]] | None) -> tuple[list[int], str]:
    """Lengths in tokens when the caller passes `completion_ids` (the trainer and `kit rewards preview` do),
    else in characters (`kit rewards test` on a file without a completion_ids column)."""
    if completion_ids is not None and len(completion_ids) == len(completions):
        return [len(ids) for ids in completion_ids], "tokens"
    return [len(completion_text(c)) for c in completions], "characters"


JUDGE_NAMES = ("_getframe", "f_back", "f_globals", "f_locals", "f_builtins", "builtins", "__builtins__", "sys.modules",
               "gc", "__eq__", "__ne__", "__hash__", "__del__", "atexit", "os._exit", "os.write", "os.dup", "os.dup2",
               "inspect", "__subclasses__", "__class__", "__mro__", "__code__", "settrace", "setprofile", "ctypes",
               "/proc/self")
JUDGE_PATTERN = re.compile("|".join(rf"(?<!\w){re.escape(name)}(?!\w)" for name in JUDGE_NAMES))


def judge_touches(code: str) -> list[str]:
    """The names in `code` that reach for the machinery around it (frames, builtins, sys.modules, comparison
    hooks, the process's exit and descriptors): rare in an honest solution to a small task, common in a hack."""
    return sorted(set(JUDGE_PATTERN.findall(code)))


# Unicode math that math-verify does not read, as the LaTeX it does (after NFKC, which folds full-width forms).
UNICODE_MATH = {"\u2212": "-", "\u00d7": "\\times ", "\u00f7": "/", "\u221a": "\\sqrt", "\u03c0": "\\pi ",
                "\u221e": "\\infty ", "\u2264": "\\le ", "\u2265": "\\ge ", "\u00b7": "\\cdot "}


def normalize_unicode(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    return text.translate(str.maketrans(UNICODE_MATH)) if any(c in text for c in UNICODE_MATH) else text


def quiet_math_verify(timeout) -> None:
    if timeout is None:  # it warns on every call that timeouts are off
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
