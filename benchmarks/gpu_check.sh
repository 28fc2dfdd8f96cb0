#!/usr/bin/env bash
# One call on a fresh GPU machine (torch, triton and transformers installed, no downloads, the
# working tree only): the triton kernels compiled and checked against the torch backend; greedy
# tokens of a tiny random Llama on the GPU equal to transformers' (CUDA graphs and eager); paged vs
# contiguous (SDPA) kernel timings; decode throughput of a Llama-3-8B-shaped random-weight model
# (bf16, 128 in / 128 out) at batch 1, 16, 64, 256 next to its memory-bandwidth roofline, with CUDA
# graphs, and eagerly at batch 1 and 16. Full logs under $OUT; the summary and tables last.
#
#   bash benchmarks/gpu_check.sh              # OUT defaults to ./gpu_check_out
#
# Without a CUDA device it runs its CPU fallbacks: the kernel check under Triton's interpreter
# (quick subset), the timing script's "no CUDA" path, and the end-to-end scripts on the CPU with a
# tiny shape (a dry run of their logic, not a measurement).
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
run greedy $PY benchmarks/gpu_e2e.py greedy
run kernel_timing $PY benchmarks/triton_attention_bench.py
run decode_graphs $PY benchmarks/gpu_e2e.py decode
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run decode_eager $PY benchmarks/gpu_e2e.py decode --enforce-eager --batches 1 16
fi

echo
echo "== summary (logs in $OUT)"
for line in "${status[@]}"; do echo "$line"; done
for name in kernel_timing decode_graphs decode_eager; do
  [ -f "$OUT/$name.log" ] && { echo; grep -h "^|" "$OUT/$name.log" || true; }
done
