#!/usr/bin/env bash
# On a GPU machine (torch with CUDA already installed): install moe_ep, run the GPU tests, then the
# intranode benchmark at the three standard points on every visible GPU. Results (JSON, logs) go
# to $OUT if set, else .out/. The CPU-marked suite is not run here (that is .ci/run's job).
#
#   bash bench/run_gpu.sh            # or: ITERS=500 bash bench/run_gpu.sh
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
PREFILL_PROGRAMS=${PREFILL_PROGRAMS:-32}   # the prefill targets are at <= 32 SMs; "" = the buffer's default
mkdir -p "$RESULTS"
t0=$SECONDS
step() { echo "== [$(( SECONDS - t0 ))s] $*"; }

step "pip install --no-deps --no-build-isolation -e ."
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .
NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
"$PYTHON" -c 'import torch, triton; print(f"   torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")'
if [ "$NGPU" -lt 1 ]; then echo "no CUDA GPU visible"; exit 1; fi

step "GPU tests: python -m pytest -q -m gpu"
set +e
"$PYTHON" -m pytest -q -m gpu 2>&1 | tee "$RESULTS/pytest_gpu.log"
test_rc=${PIPESTATUS[0]}
set -e
step "GPU tests exit status $test_rc"

bench_rc=0
jsons=()
for cfg in "decode fp8 masked" "prefill fp8 packed" "prefill bf16 packed"; do
    read -r preset dtype layout <<<"$cfg"
    json="$RESULTS/bench_${preset}_${dtype}_${layout}.json"
    args=(--preset "$preset" --dispatch-dtype "$dtype" --layout "$layout" --iters "$ITERS" --output "$json")
    if [ "$preset" = prefill ] && [ -n "$PREFILL_PROGRAMS" ]; then args+=(--num-programs "$PREFILL_PROGRAMS"); fi
    step "torchrun --nproc-per-node=$NGPU -m bench.intranode ${args[*]}"
    if "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$NGPU" -m bench.intranode "${args[@]}" \
            2>&1 | tee -a "$RESULTS/bench.log"; then
        jsons+=("$json")
    else
        bench_rc=1
        echo "   FAILED: $cfg"
    fi
done

step "summary (GPU tests exit $test_rc)"
if [ ${#jsons[@]} -gt 0 ]; then
    "$PYTHON" -m bench.intranode --summarize "${jsons[@]}"
fi
echo "GPU tests: $(tail -n 1 "$RESULTS/pytest_gpu.log")"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
