"""Evaluation and the run report: eval stages with rewards before and after SFT, the before/after table,
`kit eval` on a run's stage and on the tiny model (pass@k), `kit report`'s files and the data in its plots (SVG)."""

from __future__ import annotations

import json
import re
from xml.etree import ElementTree

import pytest
from helpers import DATA, done, metrics, run_cli, write_recipe

from kitcli.display.report import load_run
from kitcli.stages.eval import ks_for, pass_at_k

SVG = "{http://www.w3.org/2000/svg}"

EVAL_DATA = {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 12}
GREEDY = {"max_new_tokens": 4, "batch_size": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def trained_run_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("evalrun")
    stages = [
        {"name": "eval-before", "type": "eval", "data": EVAL_DATA, "generation": GREEDY,
         "rewards": ["exact_match", {"name": "format", "args": {"tags": ["answer"]}, "weight": 0.5}]},
        {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
         "train": {"max_steps": 6, "learning_rate": 2e-3, "per_device_train_batch_size": 8, "logging_steps": 2,
                   "save_steps": 100}},
        {"name": "eval-after", "type": "eval", "init": "sft", "data": EVAL_DATA, "generation": GREEDY,
         "rewards": ["exact_match", {"name": "format", "args": {"tags": ["answer"]}, "weight": 0.5}]},
    ]
    recipe = write_recipe(root / "recipe.yaml", stages, name="evalrun")
    result = run_cli("run", recipe, "--output", root / "run")
    return root / "run", result.output


def test_pass_at_k():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)
    assert ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]


@pytest.mark.slow
def test_eval_stages_score_rewards_and_print_before_after(trained_run_dir):
    run, output = trained_run_dir
    before, after = done(run / "eval-before"), done(run / "eval-after")
    for summary in (before, after):
        assert summary["n"] == 12 and summary["samples_per_prompt"] == 1
        assert summary["rewards/exact_match"] == pytest.approx(summary["exact_match"])
        weighted = summary["rewards/exact_match"] + 0.5 * summary["rewards/format_answer"]
        assert summary["reward"] == pytest.approx(weighted)
    samples = [json.loads(line) for line in (run / "eval-after" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 12 and set(samples[0]) >= {"prompt", "completion", "answer", "correct", "rewards", "reward"}
    assert "before and after training" in output
    change = after["exact_match"] - before["exact_match"]
    cells = [f"{before['exact_match']:.3f}", f"{after['exact_match']:.3f}", f"{change:+.3f}"]
    assert re.search(r"│ exact match +│" + "│".join(rf" +{re.escape(c)} " for c in cells) + "│", output)
    assert re.search(r"┃ score +┃ eval-before \(base\) ┃ eval-after \(sft\) ┃ change ┃", output)
    assert f"report: {run / 'report.md'}" in output


def test_report_files_and_plotted_data(trained_run_dir):
    run, _ = trained_run_dir
    report = (run / "report.md").read_text()
    for svg in ("sft.svg", "eval.svg"):
        assert ElementTree.parse(run / "plots" / svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"
        assert f"(plots/{svg})" in report
    assert "## Evaluation (held-out)" in report
    assert "| score | eval-before (base) | eval-after (sft) | change |" in report
    before, after = done(run / "eval-before")["exact_match"], done(run / "eval-after")["exact_match"]
    assert f"| exact match | {before:.3f} | {after:.3f} | {after - before:+.3f} |" in report
    assert "## Stage 2: sft (sft)" in report

    # the loss panel of sft.svg draws the logged losses: its data, and its points in the same order on the page
    logged = metrics(run / "sft")
    figure = ElementTree.parse(run / "plots" / "sft.svg").getroot()
    loss = next(g for g in figure.iter(SVG + "g") if g.get("data-title") == "loss")
    line = loss.find(SVG + "polyline")
    assert [float(x) for x in line.get("data-x").split(",")] == [r["step"] for r in logged if "loss" in r] == [2, 4, 6]
    losses = [r["loss"] for r in logged if "loss" in r]
    assert [float(y) for y in line.get("data-y").split(",")] == pytest.approx(losses, rel=1e-5)
    points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert [x for x, _ in points] == sorted(x for x, _ in points)
    by_value = sorted(range(3), key=lambda i: losses[i])
    assert sorted(range(3), key=lambda i: -points[i][1]) == by_value  # a higher loss is drawn higher
    assert figure.find(SVG + "title").text == "stage 2: sft (sft)"
    bars = ElementTree.parse(run / "plots" / "eval.svg").getroot()
    exact = next(g for g in bars.iter(SVG + "g") if g.get("data-label") == "exact match")
    assert [float(v) for v in exact.get("data-y").split(",")] == pytest.approx([before, after], abs=1e-6)
    heights = [float(r.get("height")) for r in exact.iter(SVG + "rect")]
    assert (heights[0] < heights[1]) == (before < after)

    (run / "report.md").unlink()
    result = run_cli("report", run)
    assert result.output.strip() == f"report: {run / 'report.md'}" and (run / "report.md").exists()
    assert [s.status for s in load_run(run).stages] == ["done", "done", "done"]


def test_kit_eval_on_a_stage_and_a_model(trained_run_dir, tmp_path):
    run, _ = trained_run_dir
    result = run_cli("eval", run / "sft", "--data", DATA / "arithmetic_eval.jsonl", "--limit", 6, "--reward",
                     "exact_match", "--n", 4, "--temperature", 0.8, "--max-new-tokens", 4, "--json",
                     "--output", tmp_path / "out")
    summary = json.loads(result.stdout)
    assert summary["model"] == f"{run.name}/sft" and summary["n"] == 6 and summary["samples_per_prompt"] == 4
    assert set(summary) >= {"exact_match", "pass@1", "pass@2", "pass@4", "rewards/exact_match", "reward"}
    assert summary["pass@1"] == pytest.approx(summary["exact_match"])
    assert summary["pass@1"] <= summary["pass@2"] <= summary["pass@4"]
    assert len((tmp_path / "out" / "samples.jsonl").read_text().splitlines()) == 24
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["pass@4"] == summary["pass@4"]

    # the run directory means its last training stage; greedy scores match the eval-after stage on the same rows
    same = json.loads(run_cli("eval", run, "--data", DATA / "arithmetic_eval.jsonl", "--limit", 12,
                              "--max-new-tokens", 4, "--json").stdout)
    assert same["model"] == f"{run.name}/sft"
    assert same["exact_match"] == pytest.approx(done(run / "eval-after")["exact_match"])

    base = run_cli("eval", "tiny", "--data", DATA / "arithmetic_eval.jsonl", "--limit", 4, "--max-new-tokens", 4)
    assert "exact match" in base.output and "tiny on arithmetic_eval.jsonl" in base.output


def test_kit_eval_and_report_errors(trained_run_dir, tmp_path):
    run, _ = trained_run_dir
    wrong = run_cli("eval", run / "eval-after", "--data", DATA / "arithmetic_eval.jsonl", expect=2)
    assert "an eval stage saves no model" in wrong.output and "(sft)" in wrong.output
    greedy = run_cli("eval", "tiny", "--data", DATA / "arithmetic_eval.jsonl", "--n", 4, "--temperature", 0,
                     expect=2)
    assert "temperature is 0" in greedy.output
    unscored = tmp_path / "prompts.jsonl"
    unscored.write_text(json.dumps({"prompt": "hi"}) + "\n")
    nothing = run_cli("eval", "tiny", "--data", unscored, expect=2)
    assert "nothing to score" in nothing.output
    unknown = run_cli("eval", "tiny", "--data", DATA / "arithmetic_eval.jsonl", "--reward", "exact_mach", expect=2)
    assert "Did you mean 'exact_match'" in unknown.output
    empty = run_cli("report", tmp_path, expect=2)
    assert "not a kit run directory" in empty.output

    import yaml

    fake = tmp_path / "rlhf"
    (fake / "rm" / "adapter").mkdir(parents=True)
    (fake / "recipe.lock.yaml").write_text(yaml.safe_dump(
        {"recipe": {"model": {"name": "tiny"}, "stages": [{"name": "rm", "type": "reward"}]}}))
    scorer = run_cli("eval", fake / "rm", "--data", DATA / "arithmetic_eval.jsonl", expect=2)
    assert "a reward stage is a scorer, not a policy" in scorer.output
    untrained = run_cli("eval", fake, "--data", DATA / "arithmetic_eval.jsonl", expect=2)
    assert "no stage of this run has saved a model yet" in untrained.output


def test_svg_figures_are_valid_for_awkward_data():
    """One point, a constant series, a NaN, a label with markup characters, negative bars: still one well-formed SVG
    whose drawn points stay inside their panel."""
    from kitcli.display.svgplot import PANEL_H, PANEL_W, Panel, Series, bar_figure, line_figure

    panels = [Panel("one point", "loss", [Series("loss", [3], [0.5])]),
              Panel("flat & <odd>", "kl", [Series("a<b", [1, 2, 3], [0.0, 0.0, 0.0]),
                                           Series("nan", [1, 2, 3], [1.0, float("nan"), 2.0])])]
    root = ElementTree.fromstring(line_figure("t & <u>", panels))
    assert root.find(SVG + "title").text == "t & <u>"
    for line in root.iter(SVG + "polyline"):
        for point in line.get("points").split():
            x, y = map(float, point.split(","))
            assert 0 <= x <= PANEL_W and 0 <= y <= PANEL_H
    assert {line.get("data-label") for line in root.iter(SVG + "polyline")} == {"loss", "a<b", "nan"}
    bars = ElementTree.fromstring(bar_figure("bars", ["x\n(base)", "y"], [Series("change", [0, 1], [-0.2, 0.4])],
                                             "stage", "score"))
    heights = [float(r.get("height")) for g in bars.iter(SVG + "g") if g.get("data-label") == "change"
               for r in g.iter(SVG + "rect")]
    assert heights[0] > 0 and heights[1] == pytest.approx(2 * heights[0], rel=0.02)
