#!/usr/bin/env bash
# Tuning sweep on a GPU machine: the prefill kernels at a fixed program count, over payload tile
# scale (MOE_EP_TILE), warps per program (MOE_EP_NUM_WARPS) and pipeline stages of the payload
# loops (MOE_EP_STAGES, default 1); one moe_ep.bench.intranode run per point, then one line per point
# (kernel p50 of dispatch and combine, graph p50, closed-form check).
#
#   CONFIGS="1:16:fp8 2:16:fp8 2:16:fp8:3 4:16:bf16:1:rows" PROGRAMS=32 bash scripts/sweep_tiles.sh
#   (tile:warps:dtype[:stages[:layout]], layout packed by default)
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${OUT:-$PWD/.out}/tiles
mkdir -p "$RESULTS"
NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
PROGRAMS=${PROGRAMS:-32}
PRESET=${PRESET:-prefill}
ITERS=${ITERS:-100}
CONFIGS=${CONFIGS:-"1:16:fp8 2:16:fp8 4:16:fp8 8:16:fp8 2:32:fp8 4:32:fp8 1:16:bf16 4:16:bf16"}
for cfg in $CONFIGS; do
    IFS=: read -r tile warps dtype stages layout <<<"$cfg"
    stages=${stages:-1}
    layout=${layout:-packed}
    out="$RESULTS/${PRESET}_${dtype}_${layout}_p${PROGRAMS}_t${tile}_w${warps}_s${stages}.json"
    echo "== tile=$tile warps=$warps $dtype stages=$stages $layout"
    MOE_EP_TILE=$tile MOE_EP_NUM_WARPS=$warps MOE_EP_STAGES=$stages "$PYTHON" -m torch.distributed.run --nproc-per-node="$NGPU" \
        -m moe_ep.bench.intranode --preset "$PRESET" --dispatch-dtype "$dtype" --layout "$layout" --num-programs "$PROGRAMS" \
        --no-baseline --iters "$ITERS" --output "$out" >"$out.log" 2>&1 || { tail -20 "$out.log"; continue; }
    grep -m1 "kernel p50 by launch" "$out.log" || true
done
"$PYTHON" - "$RESULTS" <<'PY'
import glob, json, sys
print(f"{'config':<44} {'disp kern':>9} {'comb kern':>9} {'disp graph':>10} {'comb graph':>10} {'check':>8}")
for p in sorted(glob.glob(sys.argv[1] + "/*.json")):
    r = json.load(open(p))
    v = {(x["op"], x["mode"]): x["p50_us"] for x in r["results"]}
    chk = max(r["checks_rel_err"].values())
    name = p.rsplit("/", 1)[1][:-5]
    print(f"{name:<44} {v.get(('dispatch', 'kernel'), float('nan')):>9.1f} {v.get(('combine', 'kernel'), float('nan')):>9.1f} "
          f"{v.get(('dispatch', 'graph'), float('nan')):>10.1f} {v.get(('combine', 'graph'), float('nan')):>10.1f} {chk:>8.1e}")
PY
