"""Benchmarks through lm-evaluation-harness (kitcli/models/benchmarks.py, docs/benchmarks.md): `kit eval --tasks`
on a run's base and trained stage scores the shipped local task (examples/benchmarks/kit_arithmetic.yaml, the kit's
held-out word problems) question for question as the kit's own eval does, writes RUN/benchmarks/ and joins the
report's before/after table; an eval stage with `tasks:`; where lm-eval's exact match and the kit's differ; and bad
input, one line before any model loads. Real lm-eval, the real tiny model, offline (conftest sets HF_HUB_OFFLINE)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import DATA, done, fails, run_cli, write_recipe

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "examples" / "benchmarks"
ROWS = 20  # held-out rows scored both ways
HELD_OUT = {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": ROWS}
AS_THE_TASK = {"max_new_tokens": 32, "temperature": 0.0}  # the task's generation_kwargs: greedy, max_gen_toks 32


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, tiny_model_dir) -> Path:
    """The kit's own eval of 20 held-out rows before and after a short SFT (enough for some right answers)."""
    root = tmp_path_factory.mktemp("bench")
    stages = [{"name": "eval-before", "type": "eval", "data": HELD_OUT, "generation": AS_THE_TASK},
              {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
               "train": {"max_steps": 30, "learning_rate": 6e-3, "per_device_train_batch_size": 16,
                         "logging_steps": 10, "save_steps": 100}},
              {"name": "eval-after", "type": "eval", "init": "sft", "data": HELD_OUT, "generation": AS_THE_TASK}]
    run_cli("run", write_recipe(root / "recipe.yaml", stages, name="bench"), "--output", root / "run")
    return root / "run"


def bench(*args: str) -> tuple[dict, str]:
    """`kit eval ... --tasks kit_arithmetic` from the checkout (the task reads examples/data/ from there): the
    summary --json prints, and what went to the terminal (stderr with --json)."""
    result = run_cli("eval", *args, "--tasks", "kit_arithmetic", "--include-path", TASKS, "--apply-chat-template",
                     "--limit", ROWS, "--json")
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.slow
def test_local_task_scores_as_the_kit_eval_question_for_question(bench_run, monkeypatch):
    """Base and trained stage: lm-eval's completion of every question equals the kit's eval's, and so does the
    verdict; the scores land in RUN/benchmarks/ and beside the kit's exact match in the report's table."""
    monkeypatch.chdir(ROOT)
    counts = {}
    for stage, kit_eval in (("base", "eval-before"), ("sft", "eval-after")):
        if stage == "sft":  # a terminal (rich reads TTY_COMPATIBLE): the bar with its count and ETA
            monkeypatch.setenv("TTY_COMPATIBLE", "1")
        summary, screen = bench(str(bench_run), "--stage", stage)
        assert ("lm-eval generating" in screen and f"{ROWS}/{ROWS}" in screen and "eta" in screen) is \
            (stage == "sft"), screen
        ours = read_jsonl(bench_run / kit_eval / "samples.jsonl")
        theirs = read_jsonl(bench_run / "benchmarks" / f"{stage}-samples.jsonl")
        assert len(ours) == len(theirs) == ROWS
        for index, (kit, lm) in enumerate(zip(ours, theirs)):
            assert lm["doc_id"] == index and lm["answer"] == kit["answer"]
            assert lm["completion"] == kit["completion"], (stage, index, kit, lm)
            assert lm["correct"] is kit["correct"], (stage, index, kit, lm)
        right = sum(kit["correct"] for kit in ours)
        counts[stage] = right
        assert summary["benchmark/kit_arithmetic/exact_match,none"] == pytest.approx(right / ROWS)
        assert summary["benchmark/kit_arithmetic/exact_match,none"] == pytest.approx(done(bench_run / kit_eval)
                                                                                      ["exact_match"])
        saved = json.loads((bench_run / "benchmarks" / f"{stage}.json").read_text())
        assert saved["model"] == stage and saved["tasks"]["kit_arithmetic"]["settings"]["apply_chat_template"]
    assert counts["base"] == 0 < counts["sft"] < ROWS, counts  # the trained stage answers some, not all

    run_cli("report", bench_run)
    report = (bench_run / "report.md").read_text()
    before, after = counts["base"] / ROWS, counts["sft"] / ROWS
    assert ("| score | eval-before (base) | lm-eval (base) | eval-after (sft) | lm-eval (sft) | change |" in report
            and f"| exact match | {before:.3f} | - | {after:.3f} | - | {after - before:+.3f} |" in report
            and f"| kit_arithmetic: exact_match | - | {before:.3f} | - | {after:.3f} | {after - before:+.3f} |"
            in report and f"| prompts | {ROWS} | {ROWS} | {ROWS} | {ROWS} |  |" in report), report


def test_where_lm_evals_exact_match_differs_from_the_kits(monkeypatch):
    """The shipped task's metric (lm-eval's exact_match, case ignored, leading space and trailing space and periods
    dropped) against the kit's exact_match (rewards/builtin.py): the cases docs/benchmarks.md lists."""
    from lm_eval.tasks import TaskManager

    from kitcli.models.generate import exact_match

    monkeypatch.chdir(ROOT)
    task = TaskManager(include_path=str(TASKS), include_defaults=False).load(["kit_arithmetic"])["tasks"][
        "kit_arithmetic"]
    doc = next(iter(task.test_docs()))  # answer "2"

    def lm_eval_says(completion: str) -> bool:
        return task.process_results(doc, [completion])["exact_match"] == 1.0

    both = ["2", " 2", "2.", "2 \n", "2 ."]
    assert all(lm_eval_says(c) and exact_match(c, "2") for c in both)
    neither = ["3", "12", "2 apples", "22", "2,"]
    assert not any(lm_eval_says(c) or exact_match(c, "2") for c in neither)
    only_the_kit = ["<answer>2</answer>", "so \\boxed{2}", "\uff12"]  # a tag, \boxed{}, a full-width digit
    assert all(exact_match(c, "2") and not lm_eval_says(c) for c in only_the_kit)
    only_lm_eval = ["2. ."]  # the kit drops periods at the end, then spaces, once; the task's pattern any mix
    assert all(lm_eval_says(c) and not exact_match(c, "2") for c in only_lm_eval)
    spaced = {**doc, "answer": "1 000"}  # the kit collapses inner spaces, lm-eval compares them as they are
    assert exact_match("1  000", "1 000") and task.process_results(spaced, ["1  000"])["exact_match"] == 0.0


@pytest.mark.slow  # lm-eval indexes its ~14,000 task files (about 20 s): not for make test-fast
def test_an_eval_stage_scores_tasks_in_a_recipe(tmp_path, tiny_model_dir, monkeypatch):
    """`tasks:` instead of `data:`: lm-eval's score in DONE, its samples and record in the stage folder, and the
    run's before/after table with the kit's exact match and the task's row side by side."""
    monkeypatch.chdir(ROOT)
    stages = [{"name": "eval-before", "type": "eval", "data": {**HELD_OUT, "limit": 4}, "generation": AS_THE_TASK},
              {"name": "bench-before", "type": "eval", "tasks": ["kit_arithmetic"], "include_path": str(TASKS),
               "apply_chat_template": True, "limit": 4}]
    result = run_cli("run", write_recipe(tmp_path / "recipe.yaml", stages, name="bench-stage"), "--output",
                     tmp_path / "run")
    summary = done(tmp_path / "run" / "bench-before")
    assert summary["n"] == 4 and summary["tasks"] == ["kit_arithmetic"]
    assert summary["benchmark/kit_arithmetic/exact_match,none"] == done(tmp_path / "run" / "eval-before")["exact_match"]
    assert len(read_jsonl(tmp_path / "run" / "bench-before" / "samples.jsonl")) == 4
    record = json.loads((tmp_path / "run" / "bench-before" / "benchmarks.json").read_text())["kit_arithmetic"]
    assert record["n"] == 4 and record["settings"]["limit"] == 4 and record["lm_eval"] == "0.4.13"
    score = f"{summary['benchmark/kit_arithmetic/exact_match,none']:.3f}"
    assert f"| kit_arithmetic: exact_match | - | {score} | - |" in (tmp_path / "run" / "report.md").read_text()
    assert "kit_arith" in result.output and "lm-eval generating" not in result.output  # the table; no bar off a TTY


def test_an_eval_stage_names_data_or_tasks_not_both(tmp_path):
    base = {"name": "bench", "type": "eval"}
    cases = [({**base}, "give one"),
             ({**base, "data": HELD_OUT, "tasks": ["kit_arithmetic"]}, "not both"),
             ({**base, "data": HELD_OUT, "num_fewshot": 2}, "num_fewshot: does not apply to an eval stage with data:"),
             ({**base, "tasks": "kit_arithmetic", "rewards": ["exact_match"]},
              "rewards: does not apply to an eval stage with tasks:"),
             ({**base, "tasks": "kit_arithmetic", "include_path": "no/such/folder"}, "is not a folder")]
    for stage, message in cases:
        line = fails("run", write_recipe(tmp_path / "recipe.yaml", [stage]), "--dry-run")
        assert message in line, line


@pytest.mark.slow  # lm-eval indexes its ~14,000 task files (about 20 s): not for make test-fast
def test_bad_benchmark_input_is_one_line_before_any_model_loads(tmp_path):
    """An unknown task (with the closest names), a hub task offline, a target with no model, mixed options: exit
    2, one line, and no model was loaded (the loader's summary line never appears)."""
    def refused(*args: str) -> str:
        result = run_cli("eval", *args, expect=2)
        assert "evaluated model:" not in result.output and "Traceback" not in result.output, result.output
        return result.output.strip().splitlines()[-1]

    line = refused("tiny", "--tasks", "gsm8kk")
    assert "unknown lm-eval task 'gsm8kk'" in line and "closest: gsm8k" in line
    line = refused("tiny", "--tasks", "kit_arithmetc", "--include-path", str(TASKS))
    assert "closest: kit_arithmetic" in line
    line = refused("tiny", "--tasks", "gsm8k")
    assert "task 'gsm8k' needs the hub dataset 'openai/gsm8k'" in line and "HF_HUB_OFFLINE is set" in line
    (tmp_path / "empty").mkdir()
    assert "neither a kit run directory" in refused(str(tmp_path / "empty"), "--tasks", "gsm8k")
    unfinished = tmp_path / "unfinished"  # a run whose SFT stage has not saved an adapter yet
    (unfinished / "sft").mkdir(parents=True)
    (unfinished / "recipe.lock.yaml").write_text(yaml.safe_dump(
        {"recipe": {"name": "x", "model": {"name": "tiny", "max_seq_length": 64, "load_in_4bit": True},
                    "stages": [{"name": "sft", "type": "sft"}]}, "source": "x.yaml"}))
    assert "no finished stage that saved a policy" in refused(str(unfinished), "--tasks", "kit_arithmetic",
                                                              "--include-path", str(TASKS))
    assert "has not finished" in refused(str(unfinished), "--stage", "sft", "--tasks", "gsm8k")
    assert "has no stage 'stf'; did you mean 'sft'" in refused(str(unfinished), "--stage", "stf", "--tasks", "gsm8k")
    assert "give one of them, not both" in refused("tiny", "--tasks", "gsm8k", "--data", str(DATA / "x.jsonl"))
    assert "--reward applies to --data" in refused("tiny", "--tasks", "gsm8k", "--reward", "exact_match")
    assert "--apply-chat-template applies to --tasks" in refused("tiny", "--data", str(HELD_OUT["path"]),
                                                                 "--apply-chat-template")
    assert "--stage base: TARGET must be a run directory" in refused("tiny", "--stage", "base", "--tasks", "gsm8k")


def test_kit_help_does_not_import_lm_eval():
    code = ("import sys\nfrom kitcli.commands.cli import main\n"
            "try:\n    main(['eval', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('lm_eval', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out
