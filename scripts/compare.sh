#!/usr/bin/env bash
# One host: moe-ep-bench once per backend, each backend in its own launch, then one merged JSON,
# its table and its plot. Separate launches because torch symmetric memory has one allocation
# backend per process (moe_ep: CUDA, symm_mem: NVSHMEM) and NVSHMEM is initialised once per
# process (torch for symm_mem, DeepEP for its low-latency mode). Every launch sees the same
# inputs (same flags, same --seed).
#
#   bash scripts/compare.sh PREFIX [moe-ep-bench flags...]
#   bash scripts/compare.sh $OUT/decode --preset decode
#   bash scripts/compare.sh $OUT/prefill --preset prefill --num-sms 32
# writes PREFIX_<backend>.json, PREFIX.json (merged) and PREFIX.png (when matplotlib is there;
# else `moe-ep-bench plot PREFIX.json --output PREFIX.png` later on any machine).
# Environment: NPROC (default: the visible GPUs), BACKENDS (default "moe_ep nccl symm_mem deepep"),
# LAUNCH_TIMEOUT_S (default 1200: a hung launch is stopped and the next one runs), PYTHON.
set -uo pipefail
if [ $# -lt 1 ]; then sed -n '2,16p' "$0"; exit 2; fi
prefix=$1; shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
BACKENDS=${BACKENDS:-moe_ep nccl symm_mem deepep}
LAUNCH_TIMEOUT_S=${LAUNCH_TIMEOUT_S:-1200}
# NVLink multicast off everywhere; NVSHMEM needs no RDMA NIC on one host.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
unset TRITON_INTERPRET
mkdir -p "$(dirname "$prefix")"

rc=0
jsons=()
for b in $BACKENDS; do
    json="${prefix}_${b}.json"
    rm -f "$json"
    echo "== $b: torchrun --nproc-per-node=$NPROC -m moe_ep.bench $* --backends $b --output $json"
    timeout --kill-after=30 "$LAUNCH_TIMEOUT_S" "$PYTHON" -m torch.distributed.run --standalone \
        --nproc-per-node="$NPROC" -m moe_ep.bench "$@" --backends "$b" --output "$json"
    status=$?
    if [ "$status" -ne 0 ]; then
        echo "== $b: exit status $status" >&2
        rc=1
    fi
    if [ -s "$json" ]; then jsons+=("$json"); fi   # written after every entry: partial results count
done
if [ ${#jsons[@]} -eq 0 ]; then echo "no results" >&2; exit 1; fi
"$PYTHON" -m moe_ep.bench merge "${jsons[@]}" --output "${prefix}.json" || exit 1
echo "== merged: ${prefix}.json"
"$PYTHON" -m moe_ep.bench table "${prefix}.json"
"$PYTHON" -m moe_ep.bench plot "${prefix}.json" --output "${prefix}.png" || true   # no matplotlib: says so
exit "$rc"
