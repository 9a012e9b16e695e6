"""docs/results.md's table of the tiny recipes over seeds is rendered from bench/results/seeds.json by
bench/seeds_table.py, never typed: these tests read files and train nothing."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_table_is_the_rendering_of_the_seeds_json():
    table = load("seeds_table")
    results = json.loads((ROOT / "bench" / "results" / "seeds.json").read_text())["results"]
    rendered = table.markdown_table(results)
    assert table.docs_table(ROOT / "docs" / "results.md") == rendered, (
        "docs/results.md's seeds table differs from bench/results/seeds.json: run "
        "`python bench/seeds_table.py --update-docs`")
    assert len(rendered.splitlines()) == len(results) + 2  # a row per recipe


def pair_run(mid: float, after: float, accuracy_before: float, accuracy_after: float):
    """One seed of an SFT -> ORPO recipe: its eval summaries, stages, and the ORPO stage's own figures."""
    stages = [{"name": "eval-before", "type": "eval"}, {"name": "sft", "type": "sft"},
              {"name": "eval-mid", "type": "eval", "init": "sft"}, {"name": "orpo", "type": "orpo"},
              {"name": "eval-after", "type": "eval", "init": "orpo"}]
    evals = [{"name": "eval-before", "init": None, "summary": {"exact_match": 0.0}},
             {"name": "eval-mid", "init": "sft", "summary": {"exact_match": mid}},
             {"name": "eval-after", "init": "orpo", "summary": {"exact_match": after}}]
    figures = {"sft": {}, "orpo": {"pair_accuracy": {"before": accuracy_before, "after": accuracy_after}}}
    return (evals, stages), figures


def test_the_verdict_names_a_clear_pair_accuracy_when_exact_match_is_not_clear():
    """A method that did not clearly raise exact match, but clearly raised its own held-out pair accuracy: the
    verdict says both, and the table shows the pair accuracy before -> after; one seed whose accuracy fell takes
    the pair accuracy off the clear list."""
    seeds, table = load("seeds"), load("seeds_table")

    def result(third_accuracy_after: float):
        runs = [pair_run(0.30, 0.35, 0.80, 0.90), pair_run(0.20, 0.18, 0.82, 0.93),
                pair_run(0.25, 0.31, 0.81, third_accuracy_after)]
        return seeds.summarize("tiny-x", {s: r[0] for s, r in zip((1, 2, 3), runs)},
                               {s: r[1] for s, r in zip((1, 2, 3), runs)})

    rose = result(0.91)
    line = table.verdict(rose)
    assert line.startswith("ORPO: held-out exact match not clear (+0.03 ± 0.04, up on 2 of 3 seeds)"), line
    assert "; clear: held-out pair accuracy +0.10 ± 0.01" in line, line
    row = table.markdown_table([rose]).splitlines()[-1]
    assert "0.00 → 0.25 ± 0.05 (clear) → 0.28 ± 0.09 (+0.03 ± 0.04, not clear: 0.30→0.35, 0.20→0.18, 0.25→0.31)" in row
    assert "ORPO: held-out pair accuracy 0.81 → 0.91 (+0.10 ± 0.01, clear)" in row, row

    fell = table.verdict(result(0.79))
    assert "pair accuracy" not in fell and fell.endswith("no other measured change is clear"), fell


def test_the_figures_of_a_stage_come_from_its_done_and_its_step_zero_evaluation(tmp_path):
    """A preference stage's pair accuracy before training is its evaluation at step 0 (eval_on_start), after is
    DONE's final evaluation; a reward model's both come from DONE; an RL stage's sampled reward is its first and
    last quarter."""
    seeds = load("seeds")
    (tmp_path / "orpo").mkdir()
    (tmp_path / "orpo" / "DONE").write_text(json.dumps({"eval": {"rewards/accuracies": 0.9, "rewards/margins": 1.5}}))
    (tmp_path / "orpo" / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "eval_loss": 5.0, "eval_rewards/accuracies": 0.8, "eval_rewards/margins": 0.7}) + "\n"
        + json.dumps({"step": 10, "loss": 4.0, "rewards/accuracies": 0.6}) + "\n")
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "DONE").write_text(json.dumps({"eval_before": {"accuracy": 0.5},
                                                      "eval_after": {"accuracy": 0.9}}))
    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "DONE").write_text(json.dumps({"reward_first": 0.2, "reward_last": 0.7}))
    stages = [{"name": "orpo", "type": "orpo"}, {"name": "rm", "type": "reward"}, {"name": "grpo", "type": "grpo"},
              {"name": "eval", "type": "eval"}]
    assert seeds.read_figures(tmp_path, stages) == {
        "orpo": {"pair_accuracy": {"after": 0.9, "before": 0.8}, "margin": {"after": 1.5, "before": 0.7}},
        "rm": {"pair_accuracy": {"after": 0.9, "before": 0.5}},
        "grpo": {"sampled_reward": {"before": 0.2, "after": 0.7}}}
