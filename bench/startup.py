"""Start-up: wall time of the commands that do not train, and whether they import torch.

    python bench/startup.py [--repeat 5]

Goal: `kit --help` at most 0.3 s; no command that does not train imports torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from common import KIT, ROOT, save, timed

COMMANDS = {
    "kit --help": ["--help"],
    "kit recipes list": ["recipes", "list"],
    "kit rewards list": ["rewards", "list"],
    "kit doctor": ["doctor"],
    "kit run tiny-sft --dry-run": ["run", "tiny-sft", "--dry-run"],
}
# Which commands may import torch: doctor checks torch/bitsandbytes for real, a dry run builds the TRL configs
# exactly as the run will (after Unsloth's patches).
MAY_IMPORT_TORCH = {"kit doctor", "kit run tiny-sft --dry-run"}

PROBE = ("import sys, json, runpy\n"
         "sys.argv = ['kit'] + json.loads(sys.argv[1])\n"
         "try:\n    runpy.run_module('kitcli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
         "print('IMPORTED-TORCH', 'torch' in sys.modules, file=sys.stderr)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for label, argv in COMMANDS.items():
        times = [timed(KIT + argv, cwd=ROOT)["seconds"] for _ in range(args.repeat if "dry-run" not in label else 1)]
        probe = timed([sys.executable, "-c", PROBE, json.dumps(argv)], cwd=ROOT)["output"]
        torch_loaded = "IMPORTED-TORCH True" in probe
        rows.append({"command": label, "median_s": statistics.median(times), "min_s": min(times),
                     "imports_torch": torch_loaded, "torch_allowed": label in MAY_IMPORT_TORCH})
    print(f"{'command':32} {'median s':>9} {'min s':>7}  imports torch")
    for row in rows:
        flag = "yes" if row["imports_torch"] else "no"
        bad = "  <-- should not" if row["imports_torch"] and not row["torch_allowed"] else ""
        print(f"{row['command']:32} {row['median_s']:9.3f} {row['min_s']:7.3f}  {flag}{bad}")
    print(f"results: {save('startup', {'rows': rows})}")


if __name__ == "__main__":
    main()
