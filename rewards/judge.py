"""code_exec's judge: everything that decides a test's verdict, run in the process that owns the reward, never in
the sandbox (the judge never runs inside the judged).

A test case is an assertion or a stdin/stdout pair. `parse_tests` reads a row's test cases; an assertion is split
with `ast` into *probes*, the expressions that need the solution (calls and other non-literal expressions: the
sandbox evaluates them and sends back plain data), and the *judgement* around them, which `assertion_holds`
evaluates here on that data: comparisons (`==`, `<`, `in`, `is None`...), `not` / `and` / `or`, `isinstance` with
builtin types, literals, arithmetic on numbers, indexing, and a few pure builtins (`abs`, `len`, `sorted`, `round`,
`math.isclose`...; see PARENT_CALLS). Expected values and expected output never leave this process.

Plain data is None, bool, int, float, str, bytes and lists / tuples / dicts / sets / frozensets of those, their
types kept (`decode_plain`); comparisons then follow Python's rules on it (an honest 5.0 equals 5). An object with
its own `__eq__`, a subclass of int or str, a generator: not plain data, so the test fails.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import operator
import sys
from dataclasses import dataclass, field
from typing import Any

from rewards.plain_data import OPERATIONS, binary, bounded_round, decode_plain, unary

PROBE = "__kit_probe_"          # probes are replaced in the parsed assertion by names PROBE0, PROBE1, ...
BUILTIN_TYPES = {t.__name__: t for t in (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)}
BUILTIN_TYPES["NoneType"] = type(None)
SINGLETONS = (None, True, False, Ellipsis)
MATH_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}


# Pure functions the judge evaluates itself on plain data (name -> (function, keyword arguments it may take)).
PARENT_CALLS = {
    "abs": (abs, ()), "len": (len, ()), "sorted": (sorted, ("reverse",)), "set": (set, ()),
    "frozenset": (frozenset, ()), "list": (list, ()), "tuple": (tuple, ()), "min": (min, ()), "max": (max, ()),
    "sum": (sum, ()), "all": (all, ()), "any": (any, ()), "bool": (bool, ()), "round": (bounded_round, ()),
    "int": (int, ()), "float": (float, ()), "str": (str, ()), "type": (type, ()),
    "math.isclose": (math.isclose, ("rel_tol", "abs_tol")), "math.isnan": (math.isnan, ()),
    "math.isinf": (math.isinf, ()), "math.isfinite": (math.isfinite, ()), "math.fabs": (math.fabs, ()),
    "math.sqrt": (math.sqrt, ()), "math.floor": (math.floor, ()), "math.ceil": (math.ceil, ()),
}
PARENT_OPERATORS = tuple(OPERATIONS)
COMPARISONS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
               ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
               ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}


class UnsplittableTest(ValueError):
    """A test case the parser cannot split into sandboxed values and a judgement made here."""


@dataclass
class AssertCase:
    source: str                                          # the test case as written
    setup: list[str] = field(default_factory=list)       # its import statements, run in the sandbox first
    probes: list[str] = field(default_factory=list)      # expressions the sandbox evaluates, in order
    checks: list[ast.expr] = field(default_factory=list)  # each assert's test, probes replaced by PROBE<k> names


@dataclass
class IOCase:
    input: str
    output: str


# --- reading a row's test cases ---------------------------------------------------------------------------------

def parse_tests(value: Any) -> list[AssertCase | IOCase]:
    """A row's test cases: assert statements (`"assert f(2) == 4"`), or stdin/stdout pairs (`{"input": "2\\n",
    "output": "4\\n"}`, or APPS-style `{"inputs": [...], "outputs": [...]}`), as a list, one item, or a JSON string
    of either. Raises ValueError (UnsplittableTest for an assertion) naming what is wrong."""
    if value is None:
        return []
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in ("[", "{"):
            try:
                return parse_tests(json.loads(stripped))
            except json.JSONDecodeError:
                pass
        return [split_assertion(value)] if stripped else []
    if isinstance(value, dict):
        if "inputs" in value and "outputs" in value:
            if not isinstance(value["inputs"], list) or not isinstance(value["outputs"], list) \
                    or len(value["inputs"]) != len(value["outputs"]):
                raise ValueError("inputs and outputs must be two lists of the same length")
            return [IOCase(str(i), str(o)) for i, o in zip(value["inputs"], value["outputs"])]
        if "input" in value and "output" in value:
            return [IOCase(str(value["input"]), str(value["output"]))]
        raise ValueError(f"a test case mapping needs input and output (or inputs and outputs), got keys "
                         f"{', '.join(sorted(map(str, value)))}")
    if isinstance(value, (list, tuple)):
        return [case for item in value for case in parse_tests(item)]
    raise ValueError(f"test cases must be assert statements or input/output mappings, got {type(value).__name__}")


def split_assertion(source: str) -> AssertCase:
    """Split `source` (assert statements, optionally after import statements) into probes and checks."""
    shown = " ".join(source.split())[:120]
    try:
        tree = ast.parse(source, mode="exec")
    except SyntaxError as error:
        raise UnsplittableTest(f"assertion '{shown}' is not valid Python ({error.msg})") from None
    case = AssertCase(source)
    imported: set[str] = set()
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            case.setup.append(ast.unparse(statement))
            imported |= {(a.asname or a.name).split(".")[0] for a in statement.names}
        elif isinstance(statement, ast.Assert):
            case.checks.append(Splitter(case, imported, shown).visit(statement.test))
        else:
            raise UnsplittableTest(f"assertion '{shown}' has a statement that is neither an assert nor an import "
                                   f"({ast.unparse(statement).splitlines()[0][:40]}); write assert statements whose "
                                   f"expected values are written out, e.g. assert f(2) == 4 (unroll a "
                                   f"check(candidate) function into its asserts)")
    if not case.checks:
        raise UnsplittableTest(f"assertion '{shown}' asserts nothing; write assert statements")
    return case


class Splitter:
    """Walk an assert's test top-down: nodes the judge can evaluate stay; the rest become probes."""

    def __init__(self, case: AssertCase, imported: set[str], shown: str):
        self.case, self.imported, self.shown = case, imported, shown

    def refuse(self, why: str) -> UnsplittableTest:
        return UnsplittableTest(f"assertion '{self.shown}' cannot be split into values the sandbox computes and a "
                                f"judgement made outside it: {why}")

    def visit(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Name) and node.id in BUILTIN_TYPES:
            return node
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math" \
                and node.attr in MATH_CONSTANTS:
            return node
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            node.elts = [self.visit(e) for e in node.elts]
            return node
        if isinstance(node, ast.Dict) and None not in node.keys:
            node.keys = [self.visit(k) for k in node.keys]
            node.values = [self.visit(v) for v in node.values]
            return node
        if isinstance(node, ast.BoolOp):
            node.values = [self.visit(v) for v in node.values]
            return node
        if isinstance(node, ast.UnaryOp):
            node.operand = self.visit(node.operand)
            return node
        if isinstance(node, ast.BinOp) and isinstance(node.op, PARENT_OPERATORS):
            node.left, node.right = self.visit(node.left), self.visit(node.right)
            return node
        if isinstance(node, ast.IfExp):
            node.test, node.body, node.orelse = self.visit(node.test), self.visit(node.body), self.visit(node.orelse)
            return node
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            node.value, node.slice = self.visit(node.value), self.visit(node.slice)
            return node
        if isinstance(node, ast.Compare):
            return self.compare(node)
        if isinstance(node, ast.Call) and call_name(node) == "isinstance":
            return self.isinstance_call(node)
        if isinstance(node, ast.Call) and call_name(node) in PARENT_CALLS and self.plain_arguments(node):
            node.args = [self.visit(a) for a in node.args]
            for keyword in node.keywords:
                keyword.value = self.visit(keyword.value)
            return node
        return self.probe(node)

    def plain_arguments(self, node: ast.Call) -> bool:
        allowed = PARENT_CALLS[call_name(node)][1]
        return not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg in allowed for k in node.keywords)

    def compare(self, node: ast.Compare) -> ast.expr:
        operands = [node.left, *node.comparators]
        for index, op in enumerate(node.ops):
            if isinstance(op, (ast.Is, ast.IsNot)) and not any(is_singleton(o) for o in operands[index:index + 2]):
                raise self.refuse(f"'{ast.unparse(node)}' compares identities, which copies of values cannot have; "
                                  f"use == (is is kept for None, True, False and builtin types)")
        node.left = self.visit(node.left)
        node.comparators = [self.visit(c) for c in node.comparators]
        return node

    def isinstance_call(self, node: ast.Call) -> ast.expr:
        if len(node.args) != 2 or node.keywords:
            raise self.refuse(f"'{ast.unparse(node)}' is not isinstance(value, type)")
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        if not all(isinstance(k, ast.Name) and k.id in BUILTIN_TYPES for k in kinds):
            raise self.refuse(f"'{ast.unparse(node)}' checks a type the solution may define; only builtin types "
                              f"({', '.join(sorted(BUILTIN_TYPES))}) can be checked on plain data")
        node.args[0] = self.visit(node.args[0])
        return node

    def probe(self, node: ast.expr) -> ast.expr:
        loaded, bound = set(), set()
        for child in ast.walk(node):
            if isinstance(child, ast.Name):
                (loaded if isinstance(child.ctx, ast.Load) else bound).add(child.id)
            elif isinstance(child, ast.arg):
                bound.add(child.arg)
        if not (loaded - bound - set(dir(builtins)) - self.imported - sys.stdlib_module_names):
            raise self.refuse(f"'{ast.unparse(node)}' mentions nothing of the solution, so it would be an expected "
                              f"value computed inside the sandbox, where the code under test could see and change "
                              f"it; write it as a literal")
        self.case.probes.append(ast.unparse(node))
        return ast.copy_location(ast.Name(id=f"{PROBE}{len(self.case.probes) - 1}", ctx=ast.Load()), node)


def call_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math":
        return f"math.{func.attr}"
    return None


def is_singleton(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and any(node.value is s for s in SINGLETONS)) or \
        (isinstance(node, ast.Name) and node.id in BUILTIN_TYPES)


# --- the judgement ----------------------------------------------------------------------------------------------

class ProbeFailed(Exception):
    """A probe the judgement needs raised in the sandbox, or did not come back as plain data."""


def assertion_holds(case: AssertCase, values: dict[int, Any], problems: dict[int, str]) -> bool:
    """Whether every assert of `case` holds, given the probes' values (problems: probe -> why it has none).
    Raises ProbeFailed when a probe the judgement reads has no value, ValueError/TypeError/... when the judgement
    itself fails on the data (both mean the test fails)."""
    judge = Judgement(values, problems)
    return all(bool(judge.evaluate(check)) for check in case.checks)


class Judgement:
    def __init__(self, values: dict[int, Any], problems: dict[int, str]):
        self.values, self.problems = values, problems

    def evaluate(self, node: ast.expr) -> Any:  # one case per node type the splitter keeps
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id.startswith(PROBE):
                index = int(node.id[len(PROBE):])
                if index not in self.values:
                    raise ProbeFailed(self.problems.get(index, "no value came back"))
                return self.values[index]
            return BUILTIN_TYPES[node.id]
        if isinstance(node, ast.Attribute):
            return MATH_CONSTANTS[node.attr]
        if isinstance(node, ast.List):
            return [self.evaluate(e) for e in node.elts]
        if isinstance(node, ast.Tuple):
            return tuple(self.evaluate(e) for e in node.elts)
        if isinstance(node, ast.Set):
            return {self.evaluate(e) for e in node.elts}
        if isinstance(node, ast.Dict):
            return {self.evaluate(k): self.evaluate(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.BoolOp):
            result = None
            for value in node.values:
                result = self.evaluate(value)
                if bool(result) == isinstance(node.op, ast.Or):
                    return result
            return result
        if isinstance(node, ast.UnaryOp):
            return unary(node.op, self.evaluate(node.operand))
        if isinstance(node, ast.BinOp):
            return binary(node.op, self.evaluate(node.left), self.evaluate(node.right))
        if isinstance(node, ast.IfExp):
            return self.evaluate(node.body) if self.evaluate(node.test) else self.evaluate(node.orelse)
        if isinstance(node, ast.Subscript):
            return self.evaluate(node.value)[self.evaluate(node.slice)]
        if isinstance(node, ast.Compare):
            left = self.evaluate(node.left)
            for op, comparator in zip(node.ops, node.comparators):
                right = self.evaluate(comparator)
                if not COMPARISONS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.Call):
            if call_name(node) == "isinstance":
                return isinstance(self.evaluate(node.args[0]), self.evaluate(node.args[1]))
            function = PARENT_CALLS[call_name(node)][0]
            return function(*[self.evaluate(a) for a in node.args],
                            **{k.arg: self.evaluate(k.value) for k in node.keywords})
        raise TypeError(f"the judge cannot evaluate {type(node).__name__}")  # the splitter never keeps one


def assert_verdicts(reports: list[dict], cases: list[AssertCase], problems: list[str]) -> list[bool]:
    """One verdict per assert test from the sandbox's reports: the code ran once, each probe the judgement reads
    came back once as plain data, and every assert holds on it. Reasons for failures go to `problems`."""
    ran: dict[int, int] = {}
    code_failed: dict[int, str] = {}
    values: dict[int, dict[int, Any]] = {t: {} for t in range(len(cases))}
    why: dict[int, dict[int, str]] = {t: {} for t in range(len(cases))}
    for report in reports:
        test, probe = report.get("test"), report.get("probe")
        if type(test) is not int or not 0 <= test < len(cases):
            continue
        if probe is None:
            if report.get("ran") is True:
                ran[test] = ran.get(test, 0) + 1
            else:
                code_failed[test] = str(report.get("raised", "the code failed"))[:200]
            continue
        if type(probe) is not int or not 0 <= probe < len(cases[test].probes):
            continue
        shown = cases[test].probes[probe]
        if probe in values[test] or probe in why[test]:
            values[test].pop(probe, None)
            why[test][probe] = f"{shown} was reported twice"
        elif "value" in report:
            try:
                values[test][probe] = decode_plain(report["value"])
            except (ValueError, TypeError, RecursionError):
                why[test][probe] = f"{shown} did not come back as plain data"
        else:
            why[test][probe] = f"{shown} raised {str(report.get('raised', 'an error'))[:200]}"
    verdicts = []
    for test, case in enumerate(cases):
        if test in code_failed or ran.get(test) != 1:
            problems.append(f"test {test}: {code_failed.get(test, 'the code did not run to the end')}")
            verdicts.append(False)
            continue
        try:
            holds = assertion_holds(case, values[test], why[test])
        except ProbeFailed as failure:
            problems.append(f"test {test}: {failure}")
            holds = None
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as error:
            problems.append(f"test {test}: {type(error).__name__}: {error}"[:200])  # e.g. comparing str with int
            holds = None
        if holds is False:
            problems.append(f"test {test}: assertion failed: {' '.join(case.source.split())[:100]}")
        verdicts.append(bool(holds))
    return verdicts


# --- stdin/stdout tests -----------------------------------------------------------------------------------------

def output_lines(text: str) -> list[str]:
    """Output compared line by line, ignoring trailing spaces and blank lines at either end."""
    return [line.rstrip() for line in text.strip().splitlines()]


def output_matches(output: str, expected: str) -> bool:
    return output_lines(output) == output_lines(expected)
