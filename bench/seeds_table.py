"""The verdicts of bench/seeds.py and docs/results.md's table, rendered from bench/results/seeds.json (runs nothing):

    python bench/seeds_table.py                   # a one-line verdict per recipe, then the markdown table
    python bench/seeds_table.py --update-docs     # ... and the table written into docs/results.md

The table sits in docs/results.md between two markers (TABLE_START, TABLE_END); tests/test_results_table.py checks
that it equals this rendering of the JSON, so no figure in it is typed by hand. A verdict is about a recipe's last
training stage (the method): clear on held-out exact match or not (bench/seeds.py's rule: every seed improved and the
mean change exceeds the seed spread), with the seeds that rose, and which of the stage's other figures (a reward
model's held-out score, its own held-out pair accuracy, ...) changed clearly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kitcli.display.report import metric_label  # noqa: E402  (after the path is set)

METHODS = {"sft": "SFT", "dpo": "DPO", "kto": "KTO", "orpo": "ORPO", "simpo": "SimPO", "reward": "reward model",
           "grpo": "GRPO", "gspo": "GSPO", "rloo": "RLOO", "ppo": "PPO"}
FIGURES = {"pair_accuracy": "held-out pair accuracy", "margin": "held-out margin", "held_out_score": "held-out score",
           "sampled_reward": "sampled reward (first → last quarter of the logs)"}


def score_label(key: str) -> str:
    if key.startswith("rewards/reward_model"):
        return "held-out reward-model score"
    return "held-out " + metric_label(key)


def headline_key(scores: dict[str, Any]) -> str | None:
    """The score a verdict is about: exact match (with tools, where the eval used them)."""
    return next((k for k in ("exact_match_with_tools", "exact_match") if k in scores), None)


def own_scores(change: dict[str, Any]) -> dict[str, Any]:
    """An eval's scores besides exact match (and the exact-match reward, the same figure; the total of several
    rewards): a reward model's score, benchmarks."""
    skip = {"exact_match", "exact_match_with_tools", "rewards/exact_match", "reward"}
    return {k: v for k, v in change["scores"].items() if k not in skip}


def seeds_up(change: dict[str, Any]) -> str:
    return f"up on {sum(v > 0 for v in change['values'])} of {len(change['values'])} seeds"


def stage_label(result: dict[str, Any], stage: str) -> str:
    return METHODS.get(result.get("stages", {}).get(stage, {}).get("type", stage), stage)


def clear_figures(result: dict[str, Any], change: dict[str, Any]) -> list[str]:
    """The clear changes among a change's other scores and its training stages' own figures, as text."""
    out = [f"{score_label(k)} {v['mean']:+.2f} ± {v['std']:.2f}" for k, v in own_scores(change).items() if v["clear"]]
    for stage in change["trained"]:
        for figure, entry in result.get("stages", {}).get(stage, {}).get("figures", {}).items():
            if entry.get("change", {}).get("clear"):
                out.append(f"{FIGURES[figure]} {entry['change']['mean']:+.2f} ± {entry['change']['std']:.2f}")
    return out


def verdict(result: dict[str, Any]) -> str:
    """One line on the recipe's last training stage: clear on held-out exact match or not (the change, how many
    seeds rose), and which of its other figures changed clearly."""
    if not result["changes"]:
        return "no training stage between two evals"
    change = result["changes"][-1]
    method = " + ".join(stage_label(result, s) for s in change["trained"]) or "nothing"
    key = headline_key(change["scores"])
    others = clear_figures(result, change)
    if key is None:
        return f"{method}: no exact match to judge" + (f"; clear: {', '.join(others)}" if others else "")
    score = change["scores"][key]
    text = (f"{method}: {score_label(key)} {'clear' if score['clear'] else 'not clear'} "
            f"({score['mean']:+.2f} ± {score['std']:.2f}, {seeds_up(score)})")
    if others:
        return text + f"; {'also ' if score['clear'] else ''}clear: {', '.join(others)}"
    return text if score["clear"] else text + "; no other measured change is clear"


def level(entry: dict[str, Any]) -> str:
    return f"{entry['mean']:.2f}" if entry["std"] == 0 else f"{entry['mean']:.2f} ± {entry['std']:.2f}"


def exact_match_cell(result: dict[str, Any]) -> str:
    """Exact match at each eval, each step's change; the last (the method's) with its figures and each seed's
    before → after, in bold when clear."""
    key = headline_key(result["evals"][result["changes"][0]["from"]]) if result["changes"] else None
    if key is None:
        return "-"
    cells = [level(result["evals"][result["changes"][0]["from"]][key])]
    for index, change in enumerate(result["changes"]):
        after, moved = result["evals"][change["to"]][key], change["scores"][key]
        if index < len(result["changes"]) - 1:
            verdict_text = "clear" if moved["clear"] else f"{moved['mean']:+.2f}, not clear"
            cells.append(f"{level(after)} ({verdict_text})")
            continue
        text = f"{level(after)} ({moved['mean']:+.2f} ± {moved['std']:.2f}, "
        before = result["evals"][change["from"]][key]["values"]
        pairs = ", ".join(f"{x:.2f}→{y:.2f}" for x, y in zip(before, after["values"]))
        cells.append(f"**{text}clear)** ({pairs})" if moved["clear"] else f"{text}not clear: {pairs})")
    return " → ".join(cells)
def figure_text(label: str, entry: dict[str, Any]) -> str:
    if "change" not in entry:
        values = ", ".join(f"{v:.2f}" for v in entry["after"]["values"])
        return f"{label} {entry['after']['mean']:.2f} ({values})"
    change = entry["change"]
    moved = f"{change['mean']:+.2f} ± {change['std']:.2f}, {'clear' if change['clear'] else 'not clear'}"
    if entry.get("relative"):  # levels carry each seed's reward-model offset: the change alone
        return f"{label} {moved}"
    return f"{label} {entry['before']['mean']:.2f} → {entry['after']['mean']:.2f} ({moved})"


def figures_cell(result: dict[str, Any]) -> str:
    """Each training stage's own figures (SFT has none), and the last eval's other scores (a reward model's) with
    the last training stage."""
    parts = {stage: [figure_text(FIGURES[f], entry) for f, entry in summary["figures"].items()]
             for stage, summary in result.get("stages", {}).items()}
    if result["changes"] and result["changes"][-1]["trained"]:
        last = result["changes"][-1]
        parts.setdefault(last["trained"][-1], []).extend(
            f"{score_label(k)} {v['mean']:+.2f} ± {v['std']:.2f} ({'clear' if v['clear'] else 'not clear'})"
            for k, v in own_scores(last).items())
    return "; ".join(f"{stage_label(result, stage)}: {'; '.join(texts)}" for stage, texts in parts.items() if texts)


TABLE_ORDER = ("tiny-sft", "tiny-dpo", "tiny-orpo", "tiny-simpo", "tiny-kto", "tiny-grpo", "tiny-gspo", "tiny-rloo",
               "tiny-rlhf", "tiny-ppo")
TABLE_START = "<!-- seeds table: bench/seeds_table.py --update-docs writes it from bench/results/seeds.json -->"
TABLE_END = "<!-- end of seeds table -->"


def markdown_table(results: list[dict[str, Any]]) -> str:
    """docs/results.md's table: per recipe, exact match at each eval, the training stages' own figures, the verdict."""
    def place(result: dict[str, Any]) -> tuple[int, str]:
        name = result["recipe"]
        return (TABLE_ORDER.index(name) if name in TABLE_ORDER else len(TABLE_ORDER), name)

    lines = ["| recipe | held-out exact match: before → after SFT → after the last training stage | what the training "
             "stages measure themselves | verdict on the last training stage |", "| --- | --- | --- | --- |"]
    for result in sorted(results, key=place):
        lines.append(f"| `{result['recipe']}` | {exact_match_cell(result)} | {figures_cell(result)} | "
                     f"{verdict(result)} |")
    return "\n".join(lines)


def table_parts(path: Path) -> tuple[str, str, str]:
    """(the text before the table's start marker, the table, the text after its end marker) of `path`."""
    text = path.read_text()
    if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1:
        raise ValueError(f"{path}: the seeds table's markers are missing or doubled ({TABLE_START} ... {TABLE_END})")
    head, rest = text.split(TABLE_START)
    table, tail = rest.split(TABLE_END)
    return head, table.strip("\n"), tail


def update_docs(path: Path, table: str) -> None:
    head, _, tail = table_parts(path)
    path.write_text(f"{head}{TABLE_START}\n{table}\n{TABLE_END}{tail}")


def docs_table(path: Path) -> str:
    return table_parts(path)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "seeds.json")
    parser.add_argument("--update-docs", action="store_true", help="write the table into docs/results.md")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())["results"]
    for result in results:
        print(f"{result['recipe']}: {verdict(result)}")
    table = markdown_table(results)
    print(f"\n{table}")
    if args.update_docs:
        update_docs(ROOT / "docs" / "results.md", table)
        print("\nwrote the table into docs/results.md")


if __name__ == "__main__":
    main()
