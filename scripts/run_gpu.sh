#!/usr/bin/env bash
# On a GPU machine (torch with CUDA already installed): install moe_ep, run the GPU tests, then the
# intranode benchmark at the three standard points on every visible GPU. Results (JSON, logs) go
# to $OUT if set, else .out/. The CPU-marked suite is not run here (that is .ci/run's job).
# The multi-rank GPU tests run R rank processes on the GPUs there are: with fewer GPUs than ranks
# (one GPU: every rank on it) the ranks share them through CUDA IPC, time-sliced, so the tests
# check correctness; such timings are not NVLink timings.
#
#   bash scripts/run_gpu.sh            # or: ITERS=500 bash scripts/run_gpu.sh
#   TESTS="tests/test_shared_gpu.py" BENCH=0 bash scripts/run_gpu.sh   # some tests, no benchmark
#   INSTALL=0 bash scripts/run_gpu.sh   # no pip step: installed already, or the checkout carries
#                                    # moe_ep/native/_native*.so (a CPU build of the same platform)
#   CONFIGS="prefill fp8 rows,prefill bf16 rows" TESTS="tests/test_rows.py" bash scripts/run_gpu.sh
#   TESTS=none COPY_FLOOR=1 CONFIGS="prefill fp8 packed 132" bash scripts/run_gpu.sh   # benchmarks only
#   TESTS=none BENCH=0 HOST_POLL=1 bash scripts/run_gpu.sh   # programs polling host memory vs the GPU's host copies
#   PROFILE="1 2 4" bash scripts/run_gpu.sh   # also: host time per call (moe_ep.bench.profile_ops, decode) at R=1, 2, 4
#   PROFILE="2 4" PROFILE_MPS=1 bash scripts/run_gpu.sh   # the same with the ranks' processes under MPS
#                                    # (PROFILE_NODES runs too, when given with PROFILE_MPS=1)
#   PROFILE_NODES="2x1 2x2" bash scripts/run_gpu.sh   # the same across nodes: 2 nodes of 1 and of 2 ranks
#                                    # (MOE_EP_NODE_SIZE; the proxy over TCP loopback; ranks share the GPUs)
#   PROFILE_NODES="2x1 2x2" PROFILE_NODES_ARGS=--fused-internode bash scripts/run_gpu.sh   # one launch an op
#   PROFILE_NODES="2x1 2x1:--graph-launch=off 2x1:--fused-internode" bash scripts/run_gpu.sh   # arguments per entry
#   PROFILE_NODES="2x1" PROFILE_TREES=".whl/base" PROFILE_MPS=1 bash scripts/run_gpu.sh   # before / after in one run
#                                    # (bash scripts/ab_base.sh REV .whl/base makes the other tree; carry it)
#   NODES_BENCH="2x1" bash scripts/run_gpu.sh   # the decode pair (graph and eager) across 2 nodes of 1
#   VARIANTS="prefill 32 | fp8 rows | fp8 rows MOE_EP_MAX_CHUNKS=128
#             decode 132 | fp8 masked" bash scripts/run_gpu.sh   # tuning points, one process per line
#                                    # (moe_ep.bench.variants: "PRESET PROGRAMS | point | point ...")
#   NCU="32 fp8 packed,32 fp8 packed MOE_EP_COMBINE_WARPS=32" TESTS=none BENCH=0 bash scripts/run_gpu.sh
#                                    # hardware counters (Nsight Compute) of one prefill dispatch +
#                                    # combine per config, tuning variables for that config alone
#   SHARED=1 bash scripts/run_gpu.sh   # also: the demo as 4 ranks on the GPUs, EP16 (2 nodes x 8 ranks
#                                    # through the proxy) at decode, and the R=4 matrix under MPS
set -euo pipefail

# NVLink multicast (NVLS) stays off everywhere: NCCL, torch symmetric memory, NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
# Where the tree has no .git (copied to a GPU machine), pass MOE_EP_COMMIT=<sha> for the JSON.

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${OUT:-$PWD/.out}
ITERS=${ITERS:-200}
TESTS=${TESTS:--m gpu}        # pytest arguments
BENCH=${BENCH:-1}             # 0: no intranode benchmark
SHARED=${SHARED:-0}           # 1: the shared-GPU runs (demo x4, EP16 through the proxy, MPS)
PREFILL_PROGRAMS=${PREFILL_PROGRAMS:-32}   # the prefill targets are at <= 32 SMs; "" = the buffer's default
CONFIGS=${CONFIGS:-"decode fp8 masked,prefill fp8 packed,prefill bf16 packed"}   # "preset dtype layout [programs]", comma-separated
PROFILE=${PROFILE:-}          # rank counts for moe_ep.bench.profile_ops --preset decode (ranks share the GPUs there are)
PROFILE_MPS=${PROFILE_MPS:-0} # 1: those runs under an MPS daemon started for them (one GPU context for every rank)
PROFILE_NODES=${PROFILE_NODES:-}  # "NODESxSIZE" entries: profile_ops --preset decode across nodes
PROFILE_NODES_ARGS=${PROFILE_NODES_ARGS:-}  # more profile_ops arguments for those, e.g. "--fused-internode"
PROFILE_TREES=${PROFILE_TREES:-}  # other trees (scripts/ab_base.sh) whose PROFILE_NODES runs follow this tree's, entry by entry
NODES_BENCH=${NODES_BENCH:-}  # "NODESxSIZE" entries: moe_ep.bench.intranode --preset decode across nodes
COPY_FLOOR=${COPY_FLOOR:-0}   # 1: the copy-floor micro-benchmark (moe_ep.bench.copy_floor) at 7168- and 14336-byte rows
COPY_FLOOR_ARGS=${COPY_FLOOR_ARGS:-}   # more copy_floor arguments, e.g. "--programs 32,132 --ring-stages 2,4"
HOST_POLL=${HOST_POLL:-0}     # 1: moe_ep.bench.host_poll (pollers of a pinned host word against copies to / from host memory)
NCU=${NCU:-}                  # "programs dtype layout" configs, comma-separated: scripts/ncu_kernels.py under ncu
VARIANTS=${VARIANTS:-}        # lines "PRESET PROGRAMS | point | point ..." for moe_ep.bench.variants (kernel p50 per point)
mkdir -p "$RESULTS"
t0=$SECONDS
step() { echo "== [$(( SECONDS - t0 ))s] $*"; }

if [ "${INSTALL:-1}" = 1 ]; then   # INSTALL=0: already installed by an earlier run on this machine
    step "pip install --no-deps --no-build-isolation -e ."
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .
else
    # Or not installed at all: the package from this checkout, with a native library built
    # elsewhere (C++ loaded through ctypes, its one Python function in the stable ABI: one built
    # by any Python >= 3.10 of the same platform loads; the pip step's C++ build takes about a
    # minute, and a checkout without a library builds one on first use).
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" -c 'import moe_ep.native.library as n; n.lib()' \
        || { echo "INSTALL=0: moe_ep's native library is not loadable from $PWD (build it, or INSTALL=1)"; exit 1; }
fi
NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
"$PYTHON" -c 'import torch, triton; print(f"   torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")'
if [ "$NGPU" -lt 1 ]; then echo "no CUDA GPU visible"; exit 1; fi

test_rc=0
if [ "$TESTS" != none ]; then
    step "GPU tests: python -m pytest -q $TESTS"
    set +e
    # shellcheck disable=SC2086
    # -v: a line per test as it ends, so a run cut short by a time limit still says what passed
    "$PYTHON" -m pytest -v -rfEs --durations=10 --junitxml="$RESULTS/pytest_gpu.xml" $TESTS 2>&1 | tee "$RESULTS/pytest_gpu.log"
    test_rc=${PIPESTATUS[0]}
    set -e
    step "GPU tests exit status $test_rc"
fi

floor_rc=0
if [ "$COPY_FLOOR" = 1 ]; then
    for rb in 7168 14336; do
        step "python -m moe_ep.bench.copy_floor --row-bytes $rb"
        # shellcheck disable=SC2086
        "$PYTHON" -m moe_ep.bench.copy_floor --row-bytes "$rb" $COPY_FLOOR_ARGS --json "$RESULTS/copy_floor_$rb.json" \
            2>&1 | tee "$RESULTS/copy_floor_$rb.log" || floor_rc=1
    done
fi
if [ "$HOST_POLL" = 1 ]; then
    step "python -m moe_ep.bench.host_poll"
    "$PYTHON" -m moe_ep.bench.host_poll 2>&1 | tee "$RESULTS/host_poll.log" || floor_rc=1
fi

variants_rc=0
variant_tables=()
while IFS= read -r line; do
    [ -n "${line// }" ] || continue
    IFS='|' read -r -a parts <<<"$line"
    read -r vpreset vprogs <<<"${parts[0]}"
    vargs=(--preset "$vpreset" --num-programs "$vprogs" --iters "${VARIANT_ITERS:-50}")
    for pt in "${parts[@]:1}"; do vargs+=(--point "$(echo "$pt" | xargs)"); done
    vlog="$RESULTS/variants_${vpreset}_p${vprogs}.log"
    step "torchrun --nproc-per-node=1 -m moe_ep.bench.variants ${vargs[*]}"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=1 -m moe_ep.bench.variants "${vargs[@]}" \
        >"$vlog" 2>&1 || variants_rc=1
    variant_tables+=("$vpreset, $vprogs programs:" "$(sed -n '/^point /,$p' "$vlog")")
done <<<"$VARIANTS"

ncu_rc=0
ncu_csvs=()
IFS=, read -r -a ncu_cfgs <<<"$NCU"
# The counters of scripts/ncu_kernels.py's summary: time, DRAM bytes and rate, issue activity,
# instructions and every warp stall reason (cycles per issued instruction).
NCU_METRICS='regex:^(gpu__time_duration\.sum|dram__bytes_(read|write)\.sum|dram__throughput\.avg\.pct_of_peak_sustained_elapsed|lts__t_sector_hit_rate\.pct|smsp__inst_executed\.sum|smsp__issue_active\.avg\.pct_of_peak_sustained_active|sm__warps_active\.avg\.per_cycle_active|smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio)$'
for cfg in "${ncu_cfgs[@]}"; do
    read -r nprogs ndtype nlayout nvars <<<"$cfg"   # nvars: MOE_EP_NAME=VALUE ... for this run alone
    nargs=(--programs "$nprogs" --dtype "$ndtype" --layout "$nlayout")
    csv="$RESULTS/ncu_p${nprogs}_${ndtype}_${nlayout}$(echo "$nvars" | tr -c 'A-Za-z0-9=\n' _ | sed 's/^./_&/').csv"
    # shellcheck disable=SC2086
    env $nvars "$PYTHON" scripts/ncu_kernels.py "${nargs[@]}" >/dev/null   # compiles outside the profiler
    step "$nvars ncu ... scripts/ncu_kernels.py ${nargs[*]}"
    # shellcheck disable=SC2086
    if env $nvars ncu --clock-control none --profile-from-start off --kernel-name 'regex:dispatch_kernel|combine_kernel|route_hist' \
            --metrics "$NCU_METRICS" --csv --page raw "$PYTHON" scripts/ncu_kernels.py "${nargs[@]}" >"$csv"; then
        ncu_csvs+=("$csv")
    else
        ncu_rc=1
    fi
done

profile_rc=0
profiles=()
mps_start() {  # an MPS daemon of our own (its pipe in /tmp), for the runs until mps_stop
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/moe_ep_mps CUDA_MPS_LOG_DIRECTORY=/tmp/moe_ep_mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    # a daemon left by a run cut short (a timeout) would refuse this one's start: stop it first
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 && sleep 1 || true
    nvidia-cuda-mps-control -d && sleep 1
    trap mps_stop EXIT   # a failing step (set -e) stops it too
}
mps_stop() {
    trap - EXIT
    echo quit | nvidia-cuda-mps-control || true
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
pmps=""
if [ -n "$PROFILE$PROFILE_NODES" ] && [ "$PROFILE_MPS" = 1 ]; then
    if command -v nvidia-cuda-mps-control >/dev/null; then mps_start; pmps=" (MPS)"; else profiles+=("MPS: no nvidia-cuda-mps-control"); fi
fi
for r in $PROFILE; do
    step "torchrun --nproc-per-node=$r -m moe_ep.bench.profile_ops --preset decode"
    if "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$r" -m moe_ep.bench.profile_ops --preset decode \
            >"$RESULTS/profile_r$r.log" 2>&1; then
        grep -E "^== profile_ops|host to issue|host per|empty kernel|one native launch" "$RESULTS/profile_r$r.log" || true
        profiles+=("R=$r$pmps: $(grep -m1 'host to issue' "$RESULTS/profile_r$r.log")")
    else
        tail -n 20 "$RESULTS/profile_r$r.log"; profile_rc=1; profiles+=("R=$r$pmps: FAILED")
    fi
done
for entry in $PROFILE_NODES; do   # NODESxSIZE, or NODESxSIZE:ARG,ARG (this entry's own profile_ops arguments)
    nn=${entry%%:*}; eargs=""
    [ "$entry" = "$nn" ] || eargs=$(echo "${entry#*:}" | tr , ' ')
    nodes=${nn%x*}; size=${nn#*x}; r=$(( nodes * size ))
    for tree in . $PROFILE_TREES; do   # this tree, then each other one in turn (a before / after in one run)
        tdir=$(cd "$tree" && pwd); tname=""; [ "$tree" = . ] || tname=" [$(basename "$tdir")]"
        plog="$RESULTS/profile_nodes_$(echo "$entry" | tr -c 'A-Za-z0-9x\n' _)${tname:+_$(basename "$tdir")}.log"
        step "MOE_EP_NODE_SIZE=$size torchrun --nproc-per-node=$r -m moe_ep.bench.profile_ops --preset decode $PROFILE_NODES_ARGS $eargs$tname"
        # torchrun -m puts the working directory first on the module path: each run imports its tree's moe_ep
        # shellcheck disable=SC2086
        if (cd "$tdir" && MOE_EP_NODE_SIZE=$size PYTHONPATH="$tdir" "$PYTHON" -m torch.distributed.run --standalone \
                --nproc-per-node="$r" -m moe_ep.bench.profile_ops --preset decode $PROFILE_NODES_ARGS $eargs) >"$plog" 2>&1; then
            grep -E "^== profile_ops|host to issue|host per|device time|graph replay|proxy|    " "$plog" | head -40 || true
            profiles+=("$entry across nodes$pmps$tname: $(grep -m1 'host to issue' "$plog")")
            profiles+=("   $(grep -m1 'wall per pair' "$plog" | sed 's/;.*//' || true)")
        else
            tail -n 20 "$plog"; profile_rc=1; profiles+=("$entry across nodes$pmps$tname: FAILED")
        fi
    done
done
if [ -n "$pmps" ]; then mps_stop; fi

shared_rc=0
shared_runs=()
shared() {  # shared NAME TIMEOUT_S CMD...: one run of the shared-GPU mode, its outcome in the summary
    local name=$1 limit=$2; shift 2
    step "$name: $*"
    local t=$SECONDS
    if timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"; then
        shared_runs+=("$name ok $(( SECONDS - t ))s")
    else
        shared_runs+=("$name FAILED $(( SECONDS - t ))s"); shared_rc=1
    fi
}
if [ "$SHARED" = 1 ]; then
    TR=("$PYTHON" -m torch.distributed.run --standalone)
    shared demo_x4 300 "${TR[@]}" --nproc-per-node=4 -m moe_ep.demo
    # EP16 on the GPUs there are: 2 nodes x 8 ranks, the proxy (TCP) between the nodes, decode preset.
    shared ep16_decode 420 "${TR[@]}" --nproc-per-node=16 -m moe_ep.bench --preset decode --backends moe_ep \
        --node-size 8 --tokens 128 --iters 20 --warmup 3 --no-progress --output "$RESULTS/ep16_decode.json"
    if command -v nvidia-cuda-mps-control >/dev/null; then
        # Under MPS the ranks' programs run at once: each rank takes SMs / ranks-per-GPU programs by default.
        mps_start
        shared mps_matrix_r4 400 "$PYTHON" -m pytest -q -x tests/test_dispatch_combine.py -k "test_matrix_gpu and 4"
        shared mps_demo_x4 300 "${TR[@]}" --nproc-per-node=4 -m moe_ep.demo
        mps_stop
    else
        shared_runs+=("mps not run: no nvidia-cuda-mps-control")
    fi
fi

bench_rc=0
jsons=()
IFS=, read -r -a configs <<<"$CONFIGS"
for cfg in "${configs[@]}"; do
    [ "$BENCH" = 1 ] || break
    read -r preset dtype layout programs <<<"$cfg"
    if [ -z "$programs" ] && [ "$preset" = prefill ]; then programs=$PREFILL_PROGRAMS; fi
    json="$RESULTS/bench_${preset}_${dtype}_${layout}${programs:+_p$programs}.json"
    args=(--preset "$preset" --dispatch-dtype "$dtype" --layout "$layout" --iters "$ITERS" --output "$json")
    if [ -n "$programs" ]; then args+=(--num-programs "$programs"); fi
    # shellcheck disable=SC2206
    args+=(${BENCH_ARGS:-})   # more intranode arguments, e.g. BENCH_ARGS=--no-baseline
    step "torchrun --nproc-per-node=$NGPU -m moe_ep.bench.intranode ${args[*]}"
    if "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$NGPU" -m moe_ep.bench.intranode "${args[@]}" \
            2>&1 | tee -a "$RESULTS/bench.log"; then
        jsons+=("$json")
    else
        bench_rc=1
        echo "   FAILED: $cfg"
    fi
done

for nn in $NODES_BENCH; do
    nodes=${nn%x*}; size=${nn#*x}; r=$(( nodes * size ))
    json="$RESULTS/bench_decode_nodes_$nn.json"
    step "MOE_EP_NODE_SIZE=$size torchrun --nproc-per-node=$r -m moe_ep.bench.intranode --preset decode (across nodes)"
    if MOE_EP_NODE_SIZE=$size "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$r" \
            -m moe_ep.bench.intranode --preset decode --dispatch-dtype fp8 --layout masked --iters "$ITERS" \
            --no-baseline --output "$json" 2>&1 | tee -a "$RESULTS/bench.log"; then
        jsons+=("$json")
    else
        bench_rc=1
        echo "   FAILED: across nodes $nn"
    fi
done

step "summary (GPU tests exit $test_rc)"
if [ ${#jsons[@]} -gt 0 ]; then
    "$PYTHON" -m moe_ep.bench.intranode --summarize "${jsons[@]}"
fi
[ ${#jsons[@]} -eq 0 ] || grep "kernel p50 by launch" "$RESULTS/bench.log" | sed 's/^/   /' || true
for r in "${shared_runs[@]}"; do echo "   $r"; done
for r in "${profiles[@]}"; do echo "   $r"; done
for r in "${variant_tables[@]}"; do echo "$r" | sed 's/^/   /'; done
[ ${#ncu_csvs[@]} -eq 0 ] || "$PYTHON" scripts/ncu_kernels.py --summary "${ncu_csvs[@]}" | sed 's/^/   /'

[ "$TESTS" = none ] || "$PYTHON" - "$RESULTS/pytest_gpu.xml" <<'PY' || true
import collections, sys, xml.etree.ElementTree as ET
counts = collections.OrderedDict()
for case in ET.parse(sys.argv[1]).iter("testcase"):
    f = case.get("classname", "?").split(".")[-1] + ".py"
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    counts.setdefault(f, collections.Counter())[kind] += 1
print(f"   {'test file':<32} {'passed':>6} {'failed':>6} {'skipped':>7}")
for f, c in counts.items():
    print(f"   {f:<32} {c['passed']:>6} {c['failure'] + c['error']:>6} {c['skipped']:>7}")
PY
[ "$TESTS" = none ] || echo "GPU tests: $(tail -n 1 "$RESULTS/pytest_gpu.log")"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$shared_rc" -eq 0 ] && [ "$floor_rc" -eq 0 ] && [ "$profile_rc" -eq 0 ] \
    && [ "$variants_rc" -eq 0 ] && [ "$ncu_rc" -eq 0 ]
