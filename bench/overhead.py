"""Overhead: the same tiny SFT, DPO and GRPO stage through `kit run` and through bench/raw_trl.py (a minimal
hand-written TRL script with identical settings), alternated; wall-time and peak-RSS ratios kit / TRL.

    python bench/overhead.py [--repeat 3] [--stages sft,dpo,grpo]

Goals: wall-time ratio at most 1.02, peak-RSS ratio at most 1.05. Both sides are whole processes (imports included).
The loop columns compare TRL's own `train_runtime` (the training loop alone) on both sides, which isolates the
per-step cost of kit's callbacks (dashboard, metrics file, alarms) from its fixed cost (lock file, checks, report):
`fixed +s` is the kit's time outside the loop minus the script's (median over the alternated pairs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import KIT, ROOT, save, timed


def kit_loop_seconds(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines() if line]
    return next(r["train_runtime"] for r in reversed(rows) if "train_runtime" in r)


def raw_loop_seconds(output: str) -> float:
    return float(next(line.split()[1] for line in output.splitlines() if line.startswith("TRAIN_RUNTIME ")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stages", default="sft,dpo,grpo")
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    work = Path(tempfile.mkdtemp(prefix="kit-overhead-"))
    rows = []
    for stage in args.stages.split(","):
        recipe = ROOT / "bench" / "recipes" / f"overhead-{stage}.yaml"
        kit_runs, raw_runs = [], []
        warm = work / f"{stage}-warm"
        timed(KIT + ["run", str(recipe), "--output", str(warm), "--quiet"], env=env, cwd=ROOT)  # warm caches
        config = warm / "train" / "config.json"
        for i in range(args.repeat):
            out = work / f"{stage}-kit-{i}"
            kit_runs.append(timed(KIT + ["run", str(recipe), "--output", str(out), "--quiet"], env=env, cwd=ROOT))
            kit_runs[-1]["loop_s"] = kit_loop_seconds(out)
            raw_runs.append(timed([sys.executable, str(ROOT / "bench" / "raw_trl.py"), stage, str(config),
                                   str(work / f"{stage}-raw-{i}")], env=env, cwd=ROOT))
            raw_runs[-1]["loop_s"] = raw_loop_seconds(raw_runs[-1]["output"])
        kit_s = statistics.median(r["seconds"] for r in kit_runs)
        raw_s = statistics.median(r["seconds"] for r in raw_runs)
        kit_rss = statistics.median(r["peak_rss_mib"] for r in kit_runs)
        raw_rss = statistics.median(r["peak_rss_mib"] for r in raw_runs)
        kit_loop = statistics.median(r["loop_s"] for r in kit_runs)
        raw_loop = statistics.median(r["loop_s"] for r in raw_runs)
        # the kit's fixed cost: its time outside the training loop minus the script's, per alternated pair
        fixed = statistics.median((k["seconds"] - k["loop_s"]) - (r["seconds"] - r["loop_s"])
                                  for k, r in zip(kit_runs, raw_runs))
        rows.append({"stage": stage, "kit_s": kit_s, "trl_s": raw_s, "time_ratio": kit_s / raw_s, "fixed_s": fixed,
                     "kit_loop_s": kit_loop, "trl_loop_s": raw_loop, "loop_ratio": kit_loop / raw_loop,
                     "kit_rss_mib": kit_rss, "trl_rss_mib": raw_rss, "rss_ratio": kit_rss / raw_rss,
                     "kit_all_s": [r["seconds"] for r in kit_runs], "trl_all_s": [r["seconds"] for r in raw_runs]})
    shutil.rmtree(work, ignore_errors=True)
    print(f"{'stage':6} {'kit s':>8} {'TRL s':>8} {'ratio':>6}   {'kit loop':>8} {'TRL loop':>8} {'ratio':>6}   "
          f"{'kit MiB':>8} {'TRL MiB':>8} {'ratio':>6}   {'fixed +s':>8}")
    for r in rows:
        print(f"{r['stage']:6} {r['kit_s']:8.2f} {r['trl_s']:8.2f} {r['time_ratio']:6.3f}   "
              f"{r['kit_loop_s']:8.2f} {r['trl_loop_s']:8.2f} {r['loop_ratio']:6.3f}   "
              f"{r['kit_rss_mib']:8.0f} {r['trl_rss_mib']:8.0f} {r['rss_ratio']:6.3f}   {r['fixed_s']:+8.2f}")
    print(f"results: {save('overhead', {'repeat': args.repeat, 'rows': rows})}")


if __name__ == "__main__":
    main()
