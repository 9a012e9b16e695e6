"""code_exec against a policy that games it: the hack catalogue (tests/hack_catalogue.py) scores 0 with and without
the audit hook while honest, wrong and partly right solutions score 1, 0 and their share; expected values never
reach the sandboxed process; the parser's split of assertions, and its refusals at data time."""

from __future__ import annotations

import json
import tempfile

import pytest
from hack_catalogue import CATALOGUE, HACKS, TASKS
from helpers import run_cli, write_recipe

from rewards.judge import AssertCase, IOCase, UnsplittableTest, assert_verdicts, parse_tests, split_assertion
from rewards.sandbox import SandboxLimits, run_batch, run_tests

FAMILIES = {"comparison objects", "builtin subclasses", "replaced builtins", "harness frames and globals",
            "job and nonce", "result channel", "early exit", "buffer swap", "sys.modules tampering",
            "atexit and __del__", "printing what a test expects"}


@pytest.fixture(autouse=True)
def own_sandbox_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def catalogue_scores(audit: bool) -> dict[str, tuple[float, float]]:
    """Every entry of the catalogue through the sandbox in one batch: name -> (score, expected)."""
    limits = SandboxLimits(time_limit=3.0, audit=audit)
    results = run_batch([code for _, _, _, code, _ in CATALOGUE], [parse_tests(TASKS[task]) for _, _, task, _, _
                                                                   in CATALOGUE], limits, workers=2)
    return {name: (result.score(), expected) for (_, name, _, _, expected), result in zip(CATALOGUE, results)}


def test_the_catalogue_covers_every_family():
    assert len(HACKS) >= 15
    assert {family for family, *_ in HACKS} >= FAMILIES


@pytest.mark.parametrize("audit", [True, False], ids=["audit hook on", "audit hook off"])
def test_every_hack_scores_zero_and_honest_work_its_share(audit):
    scores = catalogue_scores(audit)
    wrong = {name: score for name, (score, expected) in scores.items() if score != pytest.approx(expected)}
    assert not wrong, f"scored other than expected: {wrong}"


SECRET = "kit-expected-7319"  # the completions below know its shape (kit-expected-<digits>), not its digits
SEARCH = """
import gc, os, re, sys
def found():
    places = [sys.argv, dict(os.environ)] + gc.get_objects()
    frame = sys._getframe()
    while frame is not None:
        places += [frame.f_locals, frame.f_globals]
        frame = frame.f_back
    for name in os.listdir("."):
        try:
            places.append(open(name, errors="replace").read())
        except OSError:
            pass
    for place in places:
        hit = re.search("kit-expected-[0-9]+", repr(place))
        if hit:
            return hit.group()
    return "nothing"
"""


@pytest.mark.parametrize("audit", [True, False])
def test_expected_values_never_reach_the_sandbox(audit):
    """Code that searches its whole process for the expected value (objects, frames, argv, environment, files)
    and returns or prints what it finds; it finds nothing, so it cannot pass."""
    limits = SandboxLimits(time_limit=3.0, audit=audit)
    results = run_batch([SEARCH + "def answer():\n    return found()", SEARCH + "print(found())"],
                        [parse_tests([f"assert answer() == {SECRET!r}"]),
                         parse_tests([{"input": "", "output": SECRET}])], limits)
    assert [r.score() for r in results] == [0.0, 0.0], [r.detail for r in results]
    honest = run_batch([f"def answer():\n    return {SECRET!r}", f"print({SECRET!r})"],
                       [parse_tests([f"assert answer() == {SECRET!r}"]),
                        parse_tests([{"input": "", "output": SECRET}])], limits)
    assert [r.score() for r in honest] == [1.0, 1.0]  # it is the search that fails, not the tests


@pytest.mark.parametrize("audit", [True, False])
def test_a_program_reaches_no_pipe_but_its_own(audit):
    """Each stdin/stdout test's child holds its own stdout and nothing else of the sandbox's: what it writes on
    every other descriptor lands nowhere (not in the other tests' output, not on the channel)."""
    spray = ("import os\nfor fd in range(3, 64):\n    try:\n"
             "        os.write(fd, b'7\\n{\"test\": 0, \"exit\": 0}\\n')\n"
             "    except OSError:\n        pass\nprint(sum(map(int, input().split())))")
    result = run_tests(spray, parse_tests(TASKS["sum"]), SandboxLimits(time_limit=3.0, audit=audit))
    assert result.verdicts == [True, True, True], result.detail


@pytest.mark.parametrize("code, test, expected", [
    ("def f():\n    return 5.0", "assert f() == 5", 1.0),                       # Python's rules on plain data
    ("def f():\n    return True", "assert f() == 1", 1.0),
    ("def f():\n    return [1, 2]", "assert f() == (1, 2)", 0.0),               # types kept: a list is no tuple
    ("def f():\n    return {(1, 2): {b'x'}, 'k': frozenset({3})}",
     "assert f() == {(1, 2): {b'x'}, 'k': frozenset({3})}", 1.0),
    ("def f():\n    return 2 ** 200", "assert f() == 2 ** 200 and f() > 10 ** 60", 1.0),
    ("def f():\n    return float('nan')", "assert f() != f()", 1.0),
    ("def f():\n    return None", "assert f() is None", 1.0),
    ("def f():\n    return [3, 1, 2]", "assert sorted(f()) == [1, 2, 3] and len(f()) == 3 and f()[0] == 3", 1.0),
    ("def f(x):\n    return x / 3", "import math\nassert math.isclose(f(1), 0.3333333, rel_tol=1e-6)", 1.0),
    ("def f(x):\n    return x * 2", "assert f(2) == 4\nassert f(3) == 7", 0.0),     # every assert of a test must hold
    ("def f(x):\n    return 1 / x", "assert f(1) == 1 or f(0) == 1", 1.0),          # `or` short-circuits past f(0)
    ("def f(x):\n    return 1 / x", "assert f(0) == 1 or f(1) == 1", 0.0),          # as in Python: f(0) raises
    ("def f():\n    return 'abc'", "assert f() < 3", 0.0),                            # the judgement raises: fail
    ("class P:\n    pass\ndef f():\n    return P()", "assert f() is not None", 0.0),  # not plain data
    ("def f():\n    return 'x' * 10", "assert f() * 10 ** 9 == ''", 0.0),             # too big for the judge
    ("def f():\n    return 'x' * (5 << 20)", "assert len(f()) == 5 << 20", 0.0),         # values past 4 MiB
    ("def f():\n    return 2 ** 200_000", "assert f() > 0", 0.0),                        # an int past 100,000 bits
])
def test_the_judge_on_plain_data(code, test, expected):
    assert run_tests(code, parse_tests([test]), SandboxLimits(time_limit=3.0)).score() == expected


def test_an_assertion_is_split_into_probes_and_a_judgement_kept_here():
    case = split_assertion("import math\nassert abs(add(0.1, 0.2) - 0.3) < 1e-9 and math.isclose(add(1, 2), 3.0)")
    assert case.setup == ["import math"]
    assert case.probes == ["add(0.1, 0.2)", "add(1, 2)"]  # no expected value, no comparison, no abs/isclose
    case = split_assertion("assert sorted(f([3, 1]), key=lambda t: -t) == [3, 1]")
    assert case.probes == ["sorted(f([3, 1]), key=lambda t: -t)"]  # a key function runs with the solution


def test_reports_are_taken_once_each_or_the_test_fails():
    """The judge reads the sandbox's reports (here written by hand, as code that forges them would): a probe or a
    run reported twice is ambiguous and fails; reports for tests or probes it did not ask for change nothing."""
    case = split_assertion("assert add(2, 3) == 5")
    ran = {"test": 0, "ran": True}

    def value(v, probe=0, test=0):
        return {"test": test, "probe": probe, "value": v}

    assert assert_verdicts([ran, value(5)], [case], []) == [True]
    assert assert_verdicts([ran, value(5), value(-1)], [case], []) == [False]  # a forged report ahead of the real one
    assert assert_verdicts([ran, value(-1), value(5)], [case], []) == [False]
    assert assert_verdicts([ran, ran, value(5)], [case], []) == [False]
    assert assert_verdicts([value(5)], [case], []) == [False]  # the code never ran
    assert assert_verdicts([ran, value({"eq": "always"})], [case], []) == [False]
    assert assert_verdicts([ran, value(5), value(5, probe=3), value(5, test=7), {"test": 7, "ran": True}],
                           [case], []) == [True]


@pytest.mark.parametrize("test, words", [
    ("x = f(2)\nassert x == 4", "neither an assert nor an import"),
    ("def check(candidate):\n    assert candidate(1) == 1\ncheck(f)", "neither an assert nor an import"),
    ("assert f(2) is f(2)", "compares identities"),
    ("assert isinstance(f(), Point)", "checks a type the solution may define"),
    ("assert f(3) == list(range(3))", "mentions nothing of the solution"),
    ("import math\nassert f(2) == math.factorial(2)", "mentions nothing of the solution"),
    ("assert f(2) ==", "is not valid Python"),
    ("import math", "asserts nothing"),
])
def test_assertions_the_parser_cannot_split_are_refused(test, words):
    with pytest.raises(UnsplittableTest, match=words):
        split_assertion(test)


def test_test_cases_in_each_shape():
    cases = parse_tests('["assert f(1) == 1", {"input": "2", "output": "4"}]')
    assert isinstance(cases[0], AssertCase) and cases[1] == IOCase("2", "4")
    assert parse_tests({"inputs": ["1", "2"], "outputs": ["1", "4"]}) == [IOCase("1", "1"), IOCase("2", "4")]
    assert parse_tests(None) == [] and parse_tests("  ") == []
    for bad in (3, {"input": "1"}, {"inputs": ["1"], "outputs": []}):
        with pytest.raises(ValueError):
            parse_tests(bad)


@pytest.mark.parametrize("tests, words", [
    (["assert add(1, 2) == 3", "result = add(1, 2)"], "row 1, column tests: assertion 'result = add(1, 2)'"),
    ([7], "row 1, column tests: test cases must be assert statements or input/output mappings, got int"),
])
def test_kit_rewards_test_refuses_tests_it_cannot_judge(tmp_path, tests, words):
    data = tmp_path / "samples.jsonl"
    rows = [{"completion": "def add(a, b): return a + b", "tests": ["assert add(1, 2) == 3"]},
            {"completion": "def add(a, b): return a + b", "tests": tests}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_cli("rewards", "test", "code_exec", "--data", data, expect=2)
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: kit rewards test: reward 'code_exec':") and words in line, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_a_stage_refuses_such_data_before_any_model_loads(tmp_path):
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]}) + "\n" +
                    json.dumps({"prompt": "Write f(x).", "tests": ["def check(f):\n    assert f(1) == 1"]}) + "\n")
    stage = {"name": "grpo", "type": "grpo", "data": str(data), "rewards": ["code_exec"], "train": {"max_steps": 1}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    result = run_cli("run", recipe, "--output", tmp_path / "run", expect=2)
    line = result.output.strip().splitlines()[-1]
    assert "reward 'code_exec'" in line and f"'{data}': row 1, column tests: assertion 'def check(f):" in line, line
    assert "Traceback" not in result.output
    assert not (tmp_path / "run" / "grpo" / "DONE").exists()
