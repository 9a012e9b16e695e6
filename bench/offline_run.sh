#!/usr/bin/env bash
# One command for a machine that reaches no package registry (the lent GPU machine, or your own offline node):
# install the wheelhouse that bench/wheelhouse.py made (.whl/, carried with the checkout) and run one script of
# bench/, its results written as they come under $OUT (the device tool's folder; bench/results where it is unset).
# The whole command ends within KIT_CAP_S seconds (default 470, under 8 minutes), install included.
#
#     bash bench/offline_run.sh bench/gpu_accept.py                 # the GPU acceptance run
#     bash bench/offline_run.sh bench/shapes.py --shape qwen3-0.6b --case sft-1024
#     bash bench/offline_run.sh bench/gpu_accept.py --reduced       # the CPU rehearsal (tests/test_offline_rehearsal.py)
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
cap=${KIT_CAP_S:-470}
site=${KIT_SITE:-/tmp/kit-site}
results=${OUT:-bench/results}
mkdir -p "$results"
if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .whl/*.whl >"$results/install.log" 2>&1; then
  cat "$results/install.log"
  exit 3
fi
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "installed $(ls .whl/*.whl | wc -l) wheels into $site in $((SECONDS - started)) s"
left=$((cap - (SECONDS - started)))
# the script gets its budget; timeout is the hard cap behind it (the script ends its own children first)
exec timeout --kill-after=5 "$left" python3 "$@" --results "$results" --budget-s $((left - 10))
