#!/usr/bin/env bash
# The checks to run when a CUDA GPU is at hand, in one go (a few minutes on one H100):
#   1. `paratrain calibrate --gpu PRESET`: GEMM, copy and fused-attention rates -> measured-PRESET.json;
#   2. bench/bench_gpu_layer.py: one GPT layer measured vs the cost model (raw, fitted, measured);
#      bench/bench_gpu_gemm.py: the 175B tp-8 layer's GEMMs at micro-batch 1-3 vs the model;
#   3. `paratrain train --bf16` on the GPU (NCCL, one process); bench/bench_gpu_step.py (fp32, bf16) and
#      `simulate` of the same;
#   4. the test suite with CUDA visible (each failure logged as it happens: OUTDIR/failures.txt).
# Usage: bash bench/gpu_checks.sh [OUTDIR] [PRESET]   (python3 must hold torch with CUDA)
#   SUITE=no skips step 4, SUITE=only runs it alone (steps 1-3 take ~3 min, the suite up to
#   SUITE_TIMEOUT=420 s more: split them where one command may run at most 10 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/gpu}}
preset=${2:-h100}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PARATRAIN_CACHE=${PARATRAIN_CACHE:-/tmp/paratrain-gpu-cache}
py=${PYTHON:-python3}
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

suite=${SUITE:-yes}
step environment
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

if [ "$suite" != only ]; then
step "calibrate --gpu $preset"
$py -m paratrain calibrate --gpu "$preset" --json >"$out/calibrate.json" && $py - "$out/calibrate.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for g in d["gemm_by_shape"]:
    print(f"GEMM {g['m']}x{g['n']}x{g['k']}: {g['flops_per_s'] / 1e12:.1f} TFLOP/s, efficiency {g['efficiency']:.3f}")
m = d["measured"]
print(f"copy {2 * m['copy_bytes'] / m['copy_s'] / 1e12:.2f} TB/s; attention {m['attention']['seconds'] * 1e3:.3f} ms")
print({k: round(d[k], 4) for k in ("gemm_efficiency", "memory_efficiency", "attention_efficiency")})
EOF

step "one layer: measured vs modelled"
$py bench/bench_gpu_layer.py --preset "$preset" --measured "$PARATRAIN_CACHE/measured-$preset.json" --json "$out/layer.json"

step "the GPT-3 175B layer's GEMMs at tp 8, micro-batch 1-3: measured vs modelled"
$py bench/bench_gpu_gemm.py --preset "$preset" --measured "$PARATRAIN_CACHE/measured-$preset.json" --json "$out/gemm.json"
# GPT-2's head over its odd 50,257-wide vocabulary (the one-GPU train step's GEMMs ran at 236 TFLOP/s)
$py bench/bench_gpu_gemm.py --preset "$preset" --model gpt2 --tp 1 --microbatches 8 --head

step "train on the GPU (bf16), a step's profile (fp32, bf16), then simulate the same"
$py -m paratrain train --model gpt2 --nproc 1 --bf16 --steps 20 --microbatch 8 --global-batch 8 --no-progress \
  --log-every 5 2>&1 | tail -n 6
$py bench/bench_gpu_step.py --model gpt2 --microbatch 8
$py bench/bench_gpu_step.py --model gpt2 --microbatch 8 --bf16
$py -m paratrain simulate --model gpt2 --cluster dgx-h100 --gpus 1 --microbatch 8 --global-batch 8 --no-dropout \
  --json >"$out/simulate.json" 2>&1
$py -c "import json,sys; d=json.load(open(sys.argv[1])); print('simulate: iteration', round(d['iteration_time_s']*1e3, 2), 'ms,', round(d['tokens_per_s']), 'tokens/s')" "$out/simulate.json"

fi

if [ "$suite" != no ]; then
step "test suite with CUDA visible"
# the README check runs `paratrain ...` commands: the console script, without touching the image's packages
$py -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || echo "(paratrain command not installed)"
rm -f "$out/failures.txt"
PARATRAIN_FAILURE_LOG="$out/failures.txt" timeout "${SUITE_TIMEOUT:-420}" $py -m pytest -p no:cacheprovider \
  -n "${SUITE_WORKERS:-8}" --dist loadfile --timeout 300 -q -rfE --tb=line -o addopts= -W ignore 2>&1 \
  | grep -v PytestBenchmarkWarning >"$out/suite.txt"
tail -n 30 "$out/suite.txt"
echo "failures as they happened (the summary above is missing when the time limit stopped the run):"
grep '^== ' "$out/failures.txt" 2>/dev/null || echo "  none"
fi
