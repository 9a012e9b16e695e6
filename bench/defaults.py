"""Fast defaults, measured: each candidate setting the kit turns on by default, timed off and on, alternated.

    python bench/defaults.py [--repeat 2]

A candidate is a stage of a bench recipe and one `train:` setting. Both sides run `kit run` in a fresh process
with `--set` forcing the value; the table shows the stage's own seconds (from its DONE file), the ratio on / off,
and the stage's final figures, so a faster default that changes the result would show. Only what a CPU can measure
is here: GPU-only defaults (Unsloth gradient checkpointing, 8-bit AdamW, vLLM generation) need `bench/gpu.py` on a
GPU, and SFT packing is not safe without flash-attention (packed rows would attend to each other).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from common import KIT, ROOT, save, timed

# (label, bench recipe, stage, setting (a train: field, or a full --set key), value off, value on)
CANDIDATES = [
    ("DPO reference log-probs precomputed (4 epochs)", "defaults-dpo", "dpo", "precompute_ref_log_probs",
     "false", "true"),
    ("16-bit base on a CPU instead of 4-bit: tiny model SFT (40 steps)", "defaults-sft", "sft",
     "model.load_in_4bit", "true", "false"),
    ("16-bit base on a CPU instead of 4-bit: SmolLM2-135M SFT (12 steps)", "defaults-smol-sft", "sft",
     "model.load_in_4bit", "true", "false"),
]


def run_once(recipe: Path, stage: str, setting: str, value: str, out: Path, env: dict) -> dict:
    key = setting if "." in setting else f"stages.{stage}.train.{setting}"
    result = timed(KIT + ["run", str(recipe), "--output", str(out), "--quiet", "--force", "--set", f"{key}={value}"],
                   env=env, cwd=ROOT)
    done = json.loads((out / stage / "DONE").read_text())
    return {"stage_s": done["seconds"], "process_s": result["seconds"], "peak_rss_mib": result["peak_rss_mib"],
            "headline": done.get("headline", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    work = Path(tempfile.mkdtemp(prefix="kit-defaults-"))
    rows = []
    for label, name, stage, setting, off, on in CANDIDATES:
        recipe = ROOT / "bench" / "recipes" / f"{name}.yaml"
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for i in range(args.repeat):
            for side, value in (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off)):
                runs[side].append(run_once(recipe, stage, setting, value, work / f"{name}-{side}-{i}", env))
        off_s = statistics.median(r["stage_s"] for r in runs["off"])
        on_s = statistics.median(r["stage_s"] for r in runs["on"])
        shown = setting if "." in setting else f"train.{setting}"
        rows.append({"candidate": label, "setting": shown, "off_s": off_s, "on_s": on_s,
                     "ratio_on_off": on_s / off_s, "off_all_s": [r["stage_s"] for r in runs["off"]],
                     "on_all_s": [r["stage_s"] for r in runs["on"]],
                     "off_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs["off"]),
                     "on_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs["on"]),
                     "off_result": runs["off"][-1]["headline"], "on_result": runs["on"][-1]["headline"]})
    shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        print(f"{r['candidate']}  ({r['setting']})")
        print(f"  off: {r['off_s']:7.2f} s  {r['off_rss_mib']:6.0f} MiB  {r['off_result']}")
        print(f"  on:  {r['on_s']:7.2f} s  {r['on_rss_mib']:6.0f} MiB  {r['on_result']}")
        print(f"  on / off: {r['ratio_on_off']:.3f}")
    print(f"results: {save('defaults', {'repeat': args.repeat, 'rows': rows})}")


if __name__ == "__main__":
    main()
