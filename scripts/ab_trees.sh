#!/usr/bin/env bash
# An A/B of two trees on one machine: the same benchmark run from each tree's own directory in
# turn (torchrun -m puts the working directory first on the module path, so each run imports the
# moe_ep of the directory it runs in), ROUNDS rounds, then every run's summary side by side.
# Alternating is what makes two trees comparable on a machine whose speed drifts.
#
#   bash scripts/ab_trees.sh BASE_DIR ROUNDS NPROC [moe_ep.bench.intranode arguments...]
#   MOE_EP_NODE_SIZE=1 bash scripts/ab_trees.sh .whl/base 4 2 --preset decode --layout rows --no-baseline
# BASE_DIR: the other tree (scripts/ab_base.sh makes one). JSON per run: $OUT/ab/{base,this}_<round>.json.
set -uo pipefail
if [ $# -lt 3 ]; then sed -n '2,10p' "$0"; exit 2; fi
base=$(cd "$1" && pwd); rounds=$2; nproc=$3; shift 3
cd "$(dirname "${BASH_SOURCE[0]}")/.."
here=$PWD
PYTHON=${PYTHON:-python3}
out=${OUT:-$here/.out}/ab
mkdir -p "$out"
unset TRITON_INTERPRET
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
rc=0
jsons=()
for r in $(seq 1 "$rounds"); do
    for side in base this; do
        dir=$here; [ "$side" = base ] && dir=$base
        json="$out/${side}_$r.json"
        echo "== round $r, $side ($dir): torchrun --nproc-per-node=$nproc -m moe_ep.bench.intranode $*"
        (cd "$dir" && PYTHONPATH="$dir" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$nproc" \
            -m moe_ep.bench.intranode "$@" --output "$json" >"$out/${side}_$r.log" 2>&1) || { rc=1; tail -5 "$out/${side}_$r.log"; }
        [ -f "$json" ] && jsons+=("$json")
    done
done
# p50 per (op, mode) and run, the runs in the order they ran, then each side's median of its runs
[ ${#jsons[@]} -eq 0 ] || "$PYTHON" - "${jsons[@]}" <<'PY'
import json, os, statistics, sys
runs = [(os.path.basename(p)[:-5], json.load(open(p))) for p in sys.argv[1:]]
keys = [(r["op"], r["mode"]) for r in runs[0][1]["results"]]
p50 = {name: {(r["op"], r["mode"]): r["p50_us"] for r in res["results"]} for name, res in runs}
c = runs[0][1]["config"]
print(f"A/B p50 us: {c['preset']} T={c['num_tokens']} R={c['world_size']} {c['dispatch_dtype']} {c['layout']}")
print(f"{'op':<17} {'mode':<6} " + " ".join(f"{n:>9}" for n, _ in runs) + f" {'base med':>9} {'this med':>9}")
for k in keys:
    med = [statistics.median([p50[n][k] for n, _ in runs if n.startswith(side) and k in p50[n]] or [float("nan")])
           for side in ("base", "this")]
    print(f"{k[0]:<17} {k[1]:<6} " + " ".join(f"{p50[n].get(k, float('nan')):>9.1f}" for n, _ in runs)
          + f" {med[0]:>9.1f} {med[1]:>9.1f}")
PY
exit $rc
