"""Pipeline: `make demo`'s recipe end to end, time per stage and training tokens per second.

    python bench/pipeline.py [--recipe tiny-grpo]

Runs `kit run RECIPE --force --quiet` in a fresh run directory and reads each stage's DONE file (seconds) and
metrics.jsonl (TRL's `num_tokens`: tokens the trainer processed, prompts and completions). Eval stages generate
rather than train, so they show seconds only. The process wall time includes imports and model loading.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from common import KIT, ROOT, save, timed


def stage_figures(run_dir: Path) -> list[dict]:
    import yaml

    lock = yaml.safe_load((run_dir / "recipe.lock.yaml").read_text())
    rows = []
    for stage in lock["recipe"]["stages"]:
        stage_dir = run_dir / stage["name"]
        done = json.loads((stage_dir / "DONE").read_text())
        tokens = None
        metrics = stage_dir / "metrics.jsonl"
        if metrics.exists():
            counts = [json.loads(line).get("num_tokens") for line in metrics.read_text().splitlines() if line.strip()]
            counts = [c for c in counts if isinstance(c, (int, float))]
            tokens = max(counts) if counts else None
        seconds = done["seconds"]
        rows.append({"stage": stage["name"], "type": stage["type"], "seconds": seconds, "steps": done.get("steps"),
                     "tokens": tokens, "tokens_per_s": tokens / seconds if tokens and seconds else None,
                     "result": done.get("headline", "")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny-grpo", help="make demo runs tiny-grpo")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kit-pipeline-"))
    run_dir = work / args.recipe
    result = timed(KIT + ["run", args.recipe, "--output", str(run_dir), "--quiet"],
                   env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT)
    rows = stage_figures(run_dir)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{'stage':12} {'type':6} {'seconds':>8} {'steps':>6} {'tokens':>8} {'tokens/s':>9}  result")
    for r in rows:
        tokens = f"{r['tokens']:8.0f}" if r["tokens"] else f"{'-':>8}"
        rate = f"{r['tokens_per_s']:9.0f}" if r["tokens_per_s"] else f"{'-':>9}"
        print(f"{r['stage']:12} {r['type']:6} {r['seconds']:8.1f} {str(r['steps'] or '-'):>6} {tokens} {rate}  "
              f"{r['result']}")
    staged = sum(r["seconds"] for r in rows)
    print(f"stages {staged:.1f} s; whole process {result['seconds']:.1f} s (imports, model loading, report: "
          f"{result['seconds'] - staged:.1f} s); peak RSS {result['peak_rss_mib']:.0f} MiB")
    path = save("pipeline", {"recipe": args.recipe, "process_s": result["seconds"],
                             "peak_rss_mib": result["peak_rss_mib"], "rows": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
