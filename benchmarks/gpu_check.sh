#!/usr/bin/env bash
# One call on a fresh GPU machine (torch, triton and transformers installed, no downloads, the
# working tree only): the triton kernels compiled and checked against the torch backend, then
# paged vs contiguous (SDPA) kernel timings. Full logs under $OUT; a summary table last.
#
#   bash benchmarks/gpu_check.sh              # OUT defaults to ./gpu_check_out
#
# Without a CUDA device it runs its CPU fallbacks: the kernel check under Triton's interpreter
# (quick subset) and the timing script's "no CUDA" path.
#
# Not here yet (issue 13, items 2-4): greedy equality with transformers on the GPU and the
# Llama-3-8B-shaped end-to-end decode throughput need the engine's device support (weights, KV
# pool and sampling on the GPU), which is still to be built.
set -u
OUT=${OUT:-$PWD/gpu_check_out}
PY=${PY:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
status=()

run() {  # run NAME CMD...: log to $OUT/NAME.log, remember pass/fail
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  if timeout 300 "$@" >> "$OUT/$name.log" 2>&1; then status+=("$name: ok"); else status+=("$name: FAILED ($?)"); fi
  tail -n 25 "$OUT/$name.log"
}

$PY - <<'EOF' 2>&1 | tee "$OUT/env.log"
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
EOF

if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run kernels $PY -m tests.attention.triton_check
else
  run kernels env TRITON_INTERPRET=1 $PY -m tests.attention.triton_check --quick
fi
run kernel_timing $PY benchmarks/triton_attention_bench.py

echo
echo "== summary (logs in $OUT)"
for line in "${status[@]}"; do echo "$line"; done
grep -h "^|" "$OUT/kernel_timing.log" || true
