"""Built-in tools, registered under their names in the `kit.tools` entry-point group (this package's pyproject), as
a third-party package registers its own; `kit tools list` shows them.

A tool is a plain function with type hints and a Google-style docstring: TRL (transformers' `get_json_schema`)
turns them into the JSON schema the chat template puts in the prompt, so the docstrings are short (they cost prompt
tokens). A tool refuses what it cannot do by raising ValueError with a sentence for the model; the kit's guard
(tools/registry.py) returns that sentence to the model and TRL counts it as a tool failure.
"""

from __future__ import annotations

import ast
from fractions import Fraction
from pathlib import Path

from kitcli.errors import KitError
from tools.registry import tool_factory

MAX_EXPRESSION = 200      # characters of a calculator expression
MAX_EXPONENT = 64         # largest |exponent| of **
MAX_BITS = 4096           # largest numerator or denominator the calculator keeps (2**4096 has 1234 digits)
OUTPUT_CHARS = 2000       # most of a tool's text returned to the model
OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}


# --- calculator -------------------------------------------------------------------------------------------------

def calculator(expression: str) -> str:
    """Exact arithmetic on integers and fractions: + - * / ** and parentheses.

    Args:
        expression: The arithmetic to do, e.g. 12*(3+4)/5.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("give an arithmetic expression as a string, e.g. 12*(3+4)")
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is {len(expression)} characters; at most {MAX_EXPRESSION}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic (use + - * / ** and parentheses)") from None
    return format_fraction(evaluate(tree.body, expression.strip()))


def evaluate(node: ast.AST, source: str) -> Fraction:
    """The exact value of an arithmetic syntax tree; anything but numbers, + - * / ** and unary +/- is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        text = ast.get_source_segment(source, node) or repr(node.value)
        return checked(Fraction(text.replace("_", "")))  # 0.1 is 1/10 exactly, as written
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = evaluate(node.left, source), evaluate(node.right, source)
        if isinstance(node.op, ast.Add):
            return checked(left + right)
        if isinstance(node.op, ast.Sub):
            return checked(left - right)
        if isinstance(node.op, ast.Mult):
            return checked(left * right)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ValueError("division by zero")
            return checked(left / right)
        return power(left, right)
    shown = ast.get_source_segment(source, node) or type(node).__name__
    raise ValueError(f"'{shown}' is not arithmetic: only numbers, + - * / ** and parentheses")


def power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError(f"the exponent {format_fraction(exponent)} is not a whole number (no roots: results must be "
                         f"exact)")
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent {exponent} is too large (at most {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise ValueError("division by zero (0 to a negative power)")
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if bits * abs(int(exponent)) > MAX_BITS:
        raise ValueError(f"the result would have more than {MAX_BITS} bits")
    return checked(base ** int(exponent))


def checked(value: Fraction) -> Fraction:
    if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise ValueError(f"a number in the calculation has more than {MAX_BITS} bits")
    return value


def format_fraction(value: Fraction) -> str:
    """An integer when whole (`7`), else the reduced fraction (`7/2`)."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


# --- python -----------------------------------------------------------------------------------------------------

def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints.

    Args:
        code: A Python script; print the values you need.
    """
    from rewards.sandbox import SandboxLimits, run_snippet

    if not isinstance(code, str) or not code.strip():
        raise ValueError("give Python code to run as a string, e.g. print(2 ** 10)")
    limits = SandboxLimits()  # the kit's sandbox: 5 s, 512 MB, no network, a temporary directory
    result = run_snippet(code, limits=limits)
    if result.status == "ok":
        return clip(result.stdout) if result.stdout else "(no output: print the values you need)"
    if result.status == "timeout":
        raise ValueError(f"the code ran past the time limit of {limits.time_limit:g} s")
    if result.status == "memory":
        raise ValueError(f"the code ran out of memory (limit {limits.memory_mb} MB)")
    lines = [line for line in (result.stderr or "").strip().splitlines() if line.strip()]
    detail = lines[-1] if lines else f"exit status {result.exit_status}"
    raise ValueError(clip(f"the code failed: {detail}" + (f"\noutput before it: {result.stdout}"
                                                          if result.stdout else "")))


def clip(text: str) -> str:
    return text if len(text) <= OUTPUT_CHARS else text[:OUTPUT_CHARS] + f"... ({len(text) - OUTPUT_CHARS} more)"


# --- search_file ------------------------------------------------------------------------------------------------

MAX_FILE_BYTES = 8 << 20


@tool_factory
def search_file(path: str, base_dir: Path | None = None, max_lines: int = 5):
    """Read-only lookup in a local text file the recipe names: the lines that contain a query.

    `tools: [{name: search_file, args: {path: notes.txt}}]` (relative to the recipe). The file is read once, when the
    recipe is checked; the model sees the first `max_lines` matching lines with their line numbers.
    """
    file = Path(path).expanduser()
    if not file.is_absolute() and base_dir is not None:
        file = Path(base_dir) / file
    if not file.is_file():
        raise KitError(f"search_file: '{path}' is not a file (looked in {base_dir or Path.cwd()})")
    if file.stat().st_size > MAX_FILE_BYTES:
        raise KitError(f"search_file: '{path}' is over {MAX_FILE_BYTES >> 20} MB; give a smaller text file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise KitError(f"search_file: '{path}' is not UTF-8 text") from None
    if isinstance(max_lines, bool) or not isinstance(max_lines, int) or max_lines < 1:
        raise KitError(f"search_file: max_lines must be a positive integer, got {max_lines!r}")

    def search_file(query: str) -> str:
        """Find the lines of the notes file that contain a query (case-insensitive).

        Args:
            query: The text to look for.
        """
        if not isinstance(query, str) or not query.strip():
            raise ValueError("give a non-empty query string")
        wanted = query.strip().lower()
        found = [f"{number}: {line}" for number, line in enumerate(lines, start=1) if wanted in line.lower()]
        if not found:
            return f"no line contains {query.strip()!r}"
        more = f"\n({len(found) - max_lines} more lines match)" if len(found) > max_lines else ""
        return clip("\n".join(found[:max_lines]) + more)

    return search_file
