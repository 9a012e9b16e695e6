"""How far a tiny recipe's learned reward model can lead the policy: it ranks every answer 0..18 to each question.

    python bench/reward_model_ranks.py bench/runs/tiny-rlhf-seed1 bench/runs/tiny-rlhf-seed2 ...

For each run directory (a run of tiny-rlhf or tiny-ppo, whose stage `rm` wrote `rm/merged`), on the held-out questions
(arithmetic_eval) and on the RL stage's prompts (arithmetic_prompts): the share of questions whose right sum the reward
model scores above every wrong one (`right_sum_first`), the right sum's mean rank among the 19, and, for each eval
stage of the run, how often its greedy answer (its samples.jsonl) is the one the reward model scores highest
(`answer_is_rm_favourite`) beside its exact match. A policy that gave every question the reward model's favourite
answer would score `right_sum_first` in exact match: that is as far as optimizing the reward model alone can take it.
One JSON line per run; nothing is trained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kitcli.records import read_jsonl  # noqa: E402  (after the path is set)
from rewards.reward_model import RewardModelScorer  # noqa: E402

ANSWERS = range(19)  # every sum of two digits
DATA = ROOT / "examples" / "data"


def ranks(scorer: RewardModelScorer, rows: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int]]:
    """The right sum's share of first places and mean rank, and the reward model's favourite answer per question."""
    first, total_rank, favourite = 0, 0, {}
    for row in rows:
        scores = scorer.score([row["prompt"]] * len(ANSWERS),
                              [[{"role": "assistant", "content": str(a)}] for a in ANSWERS])
        right = scores[int(row["answer"])]
        best = max(ANSWERS, key=lambda a: scores[a])
        favourite[row["prompt"][-1]["content"]] = best
        first += best == int(row["answer"])
        total_rank += 1 + sum(s > right for s in scores)
    return {"right_sum_first": first / len(rows), "mean_rank": round(total_rank / len(rows), 2)}, favourite


def agreement(samples: Path, favourite: dict[str, int]) -> dict[str, float]:
    rows = read_jsonl(samples, strict=True)
    agree = sum(r["completion"].strip() == str(favourite[r["prompt"][-1]["content"]]) for r in rows)
    return {"answer_is_rm_favourite": agree / len(rows), "exact_match": sum(r["correct"] for r in rows) / len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories with a reward stage named rm")
    args = parser.parse_args()
    for run in args.runs:
        scorer = RewardModelScorer(run / "rm" / "merged", batch_size=64)
        out: dict[str, Any] = {"run": str(run)}
        for name in ("arithmetic_eval", "arithmetic_prompts"):
            rows = read_jsonl(DATA / f"{name}.jsonl", strict=True)
            out[name], favourite = ranks(scorer, rows)
            if name == "arithmetic_eval":
                held_out = favourite
        for samples in sorted(run.glob("eval-*/samples.jsonl")):
            out[samples.parent.name] = agreement(samples, held_out)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
