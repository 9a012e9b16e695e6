"""The code sandbox before and after the judge moved out of it, side by side in one run: the hack catalogue's
scores, and seconds per 100 completions.

    python bench/sandbox.py                 # 100 completions per shape (2 or 8 tests), 3 rounds, 2 workers
    python bench/sandbox.py --count 200 --rounds 5

"Before" is the sandbox of commit a1130c3 (where the code under test ran in the same interpreter as the code
that decided pass or fail), read from git into a temporary directory; "after" is this checkout's. Each round runs
both on the same completions, alternating, so that a busy machine slows both alike: compare the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "a1130c3"
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def old_sandbox(directory: Path):
    """rewards/sandbox.py (and its harness) of commit BEFORE, imported as a module of its own."""
    for name in ("sandbox.py", "sandbox_harness.py"):
        text = subprocess.run(["git", "show", f"{BEFORE}:rewards/{name}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        (directory / name).write_text(text)
    spec = importlib.util.spec_from_file_location("sandbox_before", directory / "sandbox.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_before"] = module
    spec.loader.exec_module(module)
    return module


def score_before(old, codes, tests, workers: int, audit: bool = True) -> list[float]:
    limits = old.SandboxLimits(time_limit=5.0, audit=audit)
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda pair: old.run_tests(pair[0], old.normalize_tests(pair[1]), limits).score(),
                             zip(codes, tests)))


def score_after(codes, tests, workers: int, audit: bool = True) -> list[float]:
    from rewards.judge import parse_tests
    from rewards.sandbox import SandboxLimits, run_batch

    results = run_batch(codes, [parse_tests(t) for t in tests], SandboxLimits(time_limit=5.0, audit=audit), workers)
    return [r.score() for r in results]


def completions(count: int, kind: str, tests: int, seed: int = 0) -> tuple[list[str], list]:
    """Solutions to `add` in the shape a GRPO run produces, 70% right, with `tests` assert or stdin/stdout tests."""
    rng = random.Random(seed)
    pairs = [(a, a * 7 % 11) for a in range(tests)]
    if kind == "assert":
        good, wrong = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"
        cases = [f"assert add({a}, {b}) == {a + b}" for a, b in pairs]
    else:
        good = "a, b = map(int, input().split())\nprint(a + b)"
        wrong = "a, b = map(int, input().split())\nprint(a - b)"
        cases = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in pairs]
    return [good if rng.random() < 0.7 else wrong for _ in range(count)], [cases] * count


def catalogue(old) -> None:
    from hack_catalogue import CATALOGUE, HACKS, TASKS

    codes, tests = [e[3] for e in CATALOGUE], [TASKS[e[2]] for e in CATALOGUE]
    print(f"hack catalogue: {len(HACKS)} hacks, {len(CATALOGUE) - len(HACKS)} honest / wrong / partly right")
    print(f"{'sandbox':28} {'audit hook':>10} {'hacks > 0':>10} {'top hack':>9} {'others as expected':>19}")
    for audit in (True, False):
        for label, scores in ((f"before ({BEFORE})", score_before(old, codes, tests, 2, audit)),
                              ("after", score_after(codes, tests, 2, audit))):
            hacked = [s for s, e in zip(scores, CATALOGUE) if e in HACKS and s > 0]
            others = sum(abs(s - e[4]) < 1e-9 for s, e in zip(scores, CATALOGUE) if e not in HACKS)
            print(f"{label:28} {'on' if audit else 'off':>10} {len(hacked):>10} {max(hacked, default=0):>9.2f} "
                  f"{others:>10}/{len(CATALOGUE) - len(HACKS)}")


def timing(old, count: int, rounds: int, workers: int) -> None:
    print(f"\nseconds per 100 completions ({workers} workers, median of {rounds} alternating rounds)")
    print(f"{'tests':18} {'before':>8} {'after':>8} {'after/before':>13}")
    for kind, n in (("assert", 2), ("stdin/stdout", 2), ("assert", 8), ("stdin/stdout", 8)):
        codes, tests = completions(count, kind, n)
        before, after = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            score_before(old, codes, tests, workers)
            before.append((time.perf_counter() - started) * 100 / count)
            started = time.perf_counter()
            score_after(codes, tests, workers)
            after.append((time.perf_counter() - started) * 100 / count)
        b, a = statistics.median(before), statistics.median(after)
        print(f"{f'{n} x {kind}':18} {b:8.2f} {a:8.2f} {a / b:13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="completions per shape and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="sandboxes at a time (code_exec's default: 2)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        old = old_sandbox(Path(directory))
        catalogue(old)
        timing(old, options.count, options.rounds, options.workers)


if __name__ == "__main__":
    main()
