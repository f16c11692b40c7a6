#!/usr/bin/env bash
# Everything the H200 checks (~10 min on a fresh machine; files land in $OUT):
#   pytest_gpu.log (all GPU tests, doctor's self-check included), bench_sparse_mla.json/.png,
#   host_profile.txt; with LAUNCHERS=1 also launcher_{lora,ppo,mtp}.jsonl + launcher_summary.json;
#   with SWEEP=1 gpu_correctness_sweep.json (every head layout and context against the reference).
#   PYTEST=0 / BENCH=0 skip those parts (pytest takes ~5 min, the bench ~4.5).
# Usage on an H200 with the package installed:  OUT=results bash scripts/gpu_check_all.sh
# LAUNCHERS=1 needs Megatron-Bridge importable (the LoRA job uses megatron.bridge.peft): pip install
#   --no-deps megatron-bridge==0.6.2 omegaconf.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-.}
if [ "${PYTEST:-1}" = 1 ]; then
  timeout 420 python3 -m pytest -m gpu tests -q -n 8 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" \
    | grep -E "^E  .*(Error|assert)|^FAILED|passed|failed" | tail -12
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout 300 python3 scripts/bench_sparse_mla.py --reference W1:64 --host-profile --out "$OUT" 2>&1 | grep -v INFO | tail -40
fi
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 300 python3 scripts/gpu_correctness_sweep.py --out "$OUT" 2>&1 | grep -v INFO | grep -E "^FAIL|within" | tail -20
fi
if [ "${LAUNCHERS:-0}" = 1 ]; then
  timeout 120 python3 scripts/gpu_launcher_proof.py --out "$OUT" 2>&1 | grep -E "^(lora|ppo|mtp) "
fi
