"""Plain data and the judge's arithmetic on it (rewards/judge.py): decoding a sandbox report into plain values, and
`+ - * / ** ...` on them, each bounded so that no value the sandbox sends can make the judge slow."""

from __future__ import annotations

import ast
import operator
from typing import Any

MAX_INT_BITS = 100_000          # plain ints beyond this are refused (they would make the judge's arithmetic slow)
MAX_SEQUENCE = 1_000_000        # longest sequence the judge's `+` / `*` may build
MAX_DEPTH = 100                 # deepest nesting of plain data
OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitAnd: operator.and_,
              ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.LShift: operator.lshift,
              ast.RShift: operator.rshift}


def bounded_round(number, ndigits=None):
    if ndigits is not None and (type(ndigits) is not int or abs(ndigits) > 400):
        raise ValueError("round: ndigits must be an int within +-400")
    return round(number, ndigits)


def decode_plain(data: Any, depth: int = 0) -> Any:
    """The value a sandbox report encodes (sandbox_harness.plain), checked to be plain data; ValueError if not."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, str, float):
        return data
    if kind is int:
        if data.bit_length() > MAX_INT_BITS:
            raise ValueError(f"an int of more than {MAX_INT_BITS} bits")
        return data
    if kind is list:
        return [decode_plain(item, depth + 1) for item in data]
    if kind is dict and len(data) == 1:
        (tag, inner), = data.items()
        if tag == "int" and type(inner) is str and len(inner) <= MAX_INT_BITS // 4 + 3:
            return int(inner, 16)
        if tag == "float" and inner in ("nan", "inf", "-inf"):
            return float(inner)
        if tag == "bytes" and type(inner) is str:
            return bytes.fromhex(inner)
        if tag in ("tuple", "set", "frozenset") and type(inner) is list:
            items = [decode_plain(item, depth + 1) for item in inner]
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(inner) is list and all(type(p) is list and len(p) == 2 for p in inner):
            return {decode_plain(k, depth + 1): decode_plain(v, depth + 1) for k, v in inner}
    raise ValueError("not plain data")


def number(value: Any) -> bool:
    return type(value) in (int, float, bool, complex)


def unary(op: ast.unaryop, value: Any) -> Any:
    if isinstance(op, ast.Not):
        return not value
    if not number(value):
        raise TypeError("arithmetic on something that is not a number")
    return {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}[type(op)](value)


def binary(op: ast.operator, left: Any, right: Any) -> Any:
    """Arithmetic on numbers (and `+` / `*` on sequences), bounded so that no value the sandbox sends can make the
    judge slow: big powers and long repetitions are refused."""
    if isinstance(op, ast.Add) and type(left) is type(right) and type(left) in (str, bytes, list, tuple):
        return left + right
    if isinstance(op, ast.Mult) and {type(left), type(right)} & {str, bytes, list, tuple}:
        count, sequence = (right, left) if type(right) is int else (left, right)
        if type(count) is not int or type(sequence) not in (str, bytes, list, tuple) \
                or len(sequence) * max(count, 0) > MAX_SEQUENCE:
            raise ValueError("repetition too long for the judge")
        return sequence * count
    if not (number(left) and number(right)):
        raise TypeError("arithmetic on something that is not a number")
    if isinstance(op, ast.Pow) and type(right) is int and type(left) in (int, bool) \
            and max(abs(left), 2).bit_length() * abs(right) > MAX_INT_BITS:
        raise ValueError("power too large for the judge")
    if isinstance(op, ast.LShift) and type(right) is int and right > MAX_INT_BITS:
        raise ValueError("shift too large for the judge")
    result = OPERATIONS[type(op)](left, right)
    if type(result) is int and result.bit_length() > MAX_INT_BITS:
        raise ValueError("an int too large for the judge")
    return result
