"""The learning proof: run tiny recipes for several seeds and check that each training stage improved what its
eval stages measure by more than the spread between seeds.

    python bench/seeds.py                                   # every recipes/tiny-*.yaml, seeds 1 2 3
    python bench/seeds.py tiny-sft tiny-grpo --seeds 1 2 3
    python bench/seeds.py tiny-sft --seeds 1 2 3 --force    # redo finished runs
    python bench/seeds_table.py --update-docs               # docs/results.md's table from the JSON (runs nothing)

Each run is `kit run RECIPE --set seed=N --output bench/runs/RECIPE-seedN --quiet` (a finished run is reused, as
`kit run` skips finished stages). The scores come from the DONE files of the run's eval stages. For each pair of
consecutive eval stages (e.g. eval-before -> eval-after, with the training stages between them) the script reports,
per score, the mean and standard deviation over seeds of both evals and of the change, and calls the change clear
when every seed improved and the mean change exceeds the larger of the two evals' seed-to-seed standard deviations
(improved is down for the share of failed tool calls, up for every other score). A reward model's score is only
defined up to a constant and each seed trains its own reward model, so for scores that include one the levels of
different seeds are not comparable; there the mean change must exceed the seed-to-seed standard deviation of the
change itself. Each training stage's own figures (a preference stage's held-out pair accuracy and margin, before
and after where the stage evaluated at step 0; a reward model's held-out pair accuracy before and after; an RL
stage's sampled reward, first and last quarter of its logs; PPO's held-out score) are summarized the same way. Each
recipe ends with a one-line verdict on its last training stage: clear on held-out exact match, or not, and which of
its other figures are clear. Results go to bench/results/seeds.json: per run `seconds` (the wall time of `kit run`,
when this invocation ran it) and `stage_seconds` (the stages' own times). bench/seeds_table.py renders the verdicts
and docs/results.md's table from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kitcli.display.report import eval_metric_keys, metric_label  # noqa: E402  (after the path is set)

sys.path.insert(0, str(ROOT / "bench"))  # seeds_table.py beside this file, also when a test loads this one by path
from seeds_table import verdict  # noqa: E402


def tiny_recipes() -> list[str]:
    return sorted(p.stem for p in (ROOT / "recipes").glob("tiny-*.yaml"))


def run_recipe(recipe: str, seed: int, runs: Path, force: bool) -> tuple[Path, float | None]:
    """The run directory and the wall time of `kit run` (None when the run had finished earlier and was reused)."""
    run_dir = runs / f"{recipe}-seed{seed}"
    reused = (run_dir / "report.md").is_file() and not force
    command = [sys.executable, "-m", "kitcli", "run", recipe, "--set", f"seed={seed}", "--output", str(run_dir),
               "--quiet"]
    if force:
        command.append("--force")
    started = time.time()
    print(f"$ {' '.join(command[2:])}", flush=True)
    result = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-15:])
        raise SystemExit(f"{recipe} seed {seed} failed (exit {result.returncode}):\n{tail}")
    return run_dir, None if reused else time.time() - started


def stage_seconds(run_dir: Path) -> float:
    """The sum of the stages' own times (DONE's seconds): the training and scoring, without process start-up and
    model loading, and the same whether the run was timed now or earlier."""
    return sum(json.loads(done.read_text()).get("seconds", 0.0) for done in run_dir.glob("*/DONE"))


def read_evals(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(eval stages in order with their DONE summaries, all stages of the recipe)."""
    import yaml

    lock = yaml.safe_load((run_dir / "recipe.lock.yaml").read_text())
    stages = lock["recipe"]["stages"]
    evals = []
    for stage in stages:
        if stage["type"] == "eval":
            done = json.loads((run_dir / stage["name"] / "DONE").read_text())
            evals.append({"name": stage["name"], "init": stage.get("init"), "summary": done})
    return evals, stages


def step_zero_evaluation(metrics: Path) -> dict[str, Any]:
    """A trainer's held-out evaluation before its first step (TRL's `eval_on_start: true`), as metrics.jsonl logged
    it; empty when the stage made none."""
    if not metrics.is_file():
        return {}
    rows = (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
    return next((row for row in rows if row.get("step") == 0 and "eval_loss" in row), {})


def stage_figures(run_dir: Path, stage: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A training stage's own figures from its DONE, {figure: {"after": y, "before": x}} ("before" where the stage
    measured it): a preference stage's held-out pair accuracy and margin (before: its step-0 evaluation), a reward
    model's held-out pair accuracy, PPO's held-out score, an RL stage's sampled reward (first / last quarter)."""
    done = json.loads((run_dir / stage["name"] / "DONE").read_text())
    figures: dict[str, dict[str, float]] = {}
    held_out = done["eval"] if isinstance(done.get("eval"), dict) else {}  # DPO, KTO, ORPO, SimPO
    start = step_zero_evaluation(run_dir / stage["name"] / "metrics.jsonl")
    for key, figure in (("rewards/accuracies", "pair_accuracy"), ("rewards/margins", "margin")):
        if isinstance(held_out.get(key), (int, float)):
            figures[figure] = {"after": held_out[key]}
            if isinstance(start.get(f"eval_{key}"), (int, float)):
                figures[figure]["before"] = start[f"eval_{key}"]
    before, after = done.get("eval_before") or {}, done.get("eval_after") or {}  # a reward model; PPO
    if "accuracy" in after:
        figures["pair_accuracy"] = {"after": after["accuracy"]}
        if "accuracy" in before:
            figures["pair_accuracy"]["before"] = before["accuracy"]
    if "eval/score" in after and "eval/score" in before:
        figures["held_out_score"] = {"before": before["eval/score"], "after": after["eval/score"]}
    if done.get("reward_first") is not None:  # GRPO, GSPO, RLOO
        figures["sampled_reward"] = {"before": done["reward_first"], "after": done["reward_last"]}
    return figures


def read_figures(run_dir: Path, stages: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    return {s["name"]: stage_figures(run_dir, s) for s in stages if s["type"] != "eval"}


LOWER_IS_BETTER = {"tool_failure_rate"}


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def scored_by_reward_model(key: str, keys: list[str]) -> bool:
    """A learned reward model's scores are only defined up to a constant (the Bradley-Terry loss ignores a shift),
    and each seed trains its own, so their levels differ between seeds by an arbitrary offset."""
    if key.startswith("rewards/reward_model"):
        return True
    return key == "reward" and any(k.startswith("rewards/reward_model") for k in keys)


def change_between(before: list[float], after: list[float], noise: float | None, lower_is_better: bool = False
                   ) -> dict[str, Any]:
    """The change per seed, its spread, and whether it is clear: every seed improved and the mean change exceeds
    `noise` (the larger seed-to-seed spread of the two levels; None: the spread of the change itself, for scores
    whose levels carry each seed's own reward-model offset)."""
    deltas = [y - x for x, y in zip(before, after)]
    change = spread(deltas)
    change["noise"] = change["std"] if noise is None else noise
    better = [-d for d in deltas] if lower_is_better else deltas
    change["clear"] = min(better) > 0 and statistics.fmean(better) > change["noise"]
    return change


def summarize(recipe: str, per_seed: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]],
              figures: dict[int, dict[str, dict[str, dict[str, float]]]] | None = None) -> dict[str, Any]:
    """Per eval stage, each score's spread over seeds; per pair of consecutive evals, each score's change; per
    training stage (`figures`: read_figures per seed), its own figures' spreads and changes."""
    seeds = sorted(per_seed)
    evals0, stages = per_seed[seeds[0]]
    names = [e["name"] for e in evals0]
    keys = eval_metric_keys([e["summary"] for e in evals0])
    scores = {}
    for index, name in enumerate(names):
        scores[name] = {key: spread([per_seed[s][0][index]["summary"][key] for s in seeds]) for key in keys
                        if all(isinstance(per_seed[s][0][index]["summary"].get(key), (int, float)) for s in seeds)}
    order = [s["name"] for s in stages]
    changes = []
    for a, b in zip(names, names[1:]):
        trained = [s["name"] for s in stages[order.index(a) + 1: order.index(b)] if s["type"] != "eval"]
        changed = {}
        for key in keys:
            if key not in scores[a] or key not in scores[b]:
                continue
            # each seed's reward model has its own offset: compare changes, not levels
            noise = None if scored_by_reward_model(key, keys) else max(scores[a][key]["std"], scores[b][key]["std"])
            changed[key] = change_between(scores[a][key]["values"], scores[b][key]["values"], noise,
                                          key in LOWER_IS_BETTER)
        changes.append({"from": a, "to": b, "trained": trained, "scores": changed})
    trained_stages = summarize_stages(stages, {s: figures[s] for s in seeds}) if figures else {}
    return {"recipe": recipe, "seeds": seeds, "evals": scores, "changes": changes, "stages": trained_stages}


def summarize_stages(stages: list[dict[str, Any]], figures: dict[int, dict[str, dict[str, dict[str, float]]]]
                     ) -> dict[str, Any]:
    """Per training stage, each of its figures that every seed has: the spread of the level after (and before, and
    the change, where every seed measured both). A figure scored by the stage's own reward model (an RL stage's
    sampled reward or PPO's score, with `reward_model:`) is judged by the spread of its change."""
    seeds = sorted(figures)
    out = {}
    for stage in stages:
        per_seed = [figures[s].get(stage["name"], {}) for s in seeds]
        summary = {}
        for figure in [f for f in per_seed[0] if all(f in p for p in per_seed)]:
            values = [p[figure] for p in per_seed]
            entry = {"after": spread([v["after"] for v in values])}
            if all("before" in v for v in values):
                entry["before"] = spread([v["before"] for v in values])
                relative = bool(stage.get("reward_model")) and figure in ("sampled_reward", "held_out_score")
                noise = None if relative else max(entry["before"]["std"], entry["after"]["std"])
                entry["change"] = change_between(entry["before"]["values"], entry["after"]["values"], noise)
                entry["relative"] = relative
            summary[figure] = entry
        if summary:
            out[stage["name"]] = {"type": stage["type"], "figures": summary}
    return out


def show(result: dict[str, Any]) -> None:
    print(f"\n{result['recipe']}  (seeds {', '.join(map(str, result['seeds']))}; mean ± std over seeds)")
    for name, scores in result["evals"].items():
        cells = "  ".join(f"{metric_label(k)} {v['mean']:.3f} ± {v['std']:.3f}" for k, v in scores.items())
        print(f"  {name:<16} {cells}")
    for change in result["changes"]:
        trained = ", ".join(change["trained"]) or "nothing"
        cells = "  ".join(f"{metric_label(k)} {v['mean']:+.3f} ± {v['std']:.3f}{' (clear)' if v['clear'] else ''}"
                          for k, v in change["scores"].items())
        print(f"  {change['from']} -> {change['to']} (trains {trained}): {cells}")
    for stage, summary in result.get("stages", {}).items():
        for figure, entry in summary["figures"].items():
            levels = f"{entry['after']['mean']:.3f} ± {entry['after']['std']:.3f}"
            if "change" in entry:
                change = entry["change"]
                levels = (f"{entry['before']['mean']:.3f} ± {entry['before']['std']:.3f} -> {levels}: "
                          f"{change['mean']:+.3f} ± {change['std']:.3f}{' (clear)' if change['clear'] else ''}")
            print(f"  {stage} {figure.replace('_', ' ')}: {levels}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="shipped recipe names (default: every recipes/tiny-*.yaml)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--runs", type=Path, default=ROOT / "bench" / "runs", help="where the run directories go")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "seeds.json")
    parser.add_argument("--force", action="store_true", help="redo finished runs")
    args = parser.parse_args()
    recipes = args.recipes or tiny_recipes()
    results, seconds, stage_times = [], {}, {}
    for recipe in recipes:
        per_seed, figures = {}, {}
        for seed in args.seeds:
            run_dir, took = run_recipe(recipe, seed, args.runs, args.force)
            if took is not None:
                seconds[f"{recipe}-seed{seed}"] = round(took, 1)
            stage_times[f"{recipe}-seed{seed}"] = round(stage_seconds(run_dir), 1)
            per_seed[seed] = read_evals(run_dir)
            figures[seed] = read_figures(run_dir, per_seed[seed][1])
        result = summarize(recipe, per_seed, figures)
        show(result)
        results.append(result)
    print()
    for result in results:
        print(f"{result['recipe']}: {verdict(result)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept = [r for r in earlier.get("results", []) if r["recipe"] not in recipes]  # other recipes' figures stay
    payload = {"machine": {"cpus": os.cpu_count(), "platform": f"{platform.system()} {platform.machine()}",
                           "python": platform.python_version()},
               # a reused run's earlier wall time may belong to a run since replaced: only this invocation's stay
               "seconds": {**{k: v for k, v in earlier.get("seconds", {}).items() if k not in stage_times}, **seconds},
               "stage_seconds": {**earlier.get("stage_seconds", {}), **stage_times},
               "results": sorted(kept + results, key=lambda r: r["recipe"])}
    if earlier.get("notes"):
        payload["notes"] = earlier["notes"]  # hand-written remarks on how earlier figures were made
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
