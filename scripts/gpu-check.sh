#!/usr/bin/env bash
# gpu-check: on a machine with an NVIDIA Hopper GPU and CUDA 13 (nvcc, cuBLAS; no other project dependency),
# builds the CUDA check/bench programs with direct nvcc commands, runs nvidia-smi, the checks + benchmarks
# (tests/gpu/gpu_check_mla.cu), compute-sanitizer memcheck on the small cases, then the GEMM stage
# (tests/gpu/gpu_check_gemm.cu: bf16 cuBLAS + FP8 block-scaled cuBLASLt, checks + V3 shapes), the ops stage
# (tests/gpu/gpu_check_ops.cu: rms_norm/silu_mul/rope vs the CPU backend, MoE routing vs the model's rule, token
# permutation/gather/combine; V3 sizes at T = 128 and 8192; memcheck on --quick), the MLA prefill stage
# (tests/gpu/gpu_check_prefill.cu: varlen causal checks vs float64, H=128 4K/32K/8x4K timings), writes everything under
# $OUT (default build-gpu/out) and prints a short table last. Each stage runs even if an earlier one failed;
# the exit status is 0 only when all of them passed. Usage: bash scripts/gpu-check.sh
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${GPU_BUILD:-$ROOT/build-gpu}
OUT=${OUT:-$BUILD/out}
mkdir -p "$BUILD" "$OUT"
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
CUDA_BIN=$(dirname "${NVCC:-/usr/local/cuda/bin/nvcc}")
status=0
log() { echo "[gpu-check $(date +%T)] $*" | tee -a "$OUT/gpu-check.log"; }

log "nvidia-smi"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    2>&1 | tee -a "$OUT/gpu-check.log"
else
  log "nvidia-smi not found"
fi

# ---- build (3 translation units in parallel; ~20 s on one core each) ----
ARCH="-gencode=arch=compute_90a,code=sm_90a"
# No -Werror here: a new warning from the GPU machine's g++ 13 must not cost the run (CMake builds use -Werror).
NVFLAGS="-std=c++20 -O3 $ARCH -I$ROOT/include -Xcompiler=-Wall,-Wextra"
BIN=""
if [ -z "${NVCC:-}" ]; then
  log "nvcc not found: cannot build"; status=1
else
  log "building with $NVCC ($("$NVCC" --version | tail -1))"
  start=$(date +%s)
  "$NVCC" $NVFLAGS -Xptxas -v -c kernels/cuda/mla_decode.cu -o "$BUILD/mla_decode.o" >"$OUT/build-mla_decode.txt" 2>&1 &
  p1=$!
  "$NVCC" $NVFLAGS -DDEEPINFER_GPU_CHECK_CPU_BACKEND -Xcompiler=-fopenmp -c tests/gpu/gpu_check_mla.cu \
    -o "$BUILD/gpu_check_mla_cpu.o" >"$OUT/build-check-cpu.txt" 2>&1 &
  p2=$!
  "$NVCC" $NVFLAGS -c tests/gpu/gpu_check_mla.cu -o "$BUILD/gpu_check_mla.o" >"$OUT/build-check.txt" 2>&1 &
  p3=$!
  "$NVCC" $NVFLAGS -Xptxas -v -c kernels/cuda/gemm.cu -o "$BUILD/gemm.o" >"$OUT/build-gemm.txt" 2>&1 &
  p4=$!
  "$NVCC" $NVFLAGS -c tests/gpu/gpu_check_gemm.cu -o "$BUILD/gpu_check_gemm.o" >"$OUT/build-check-gemm.txt" 2>&1 &
  p5=$!
  "$NVCC" $NVFLAGS -Xptxas -v -c kernels/cuda/fused_ops.cu -o "$BUILD/fused_ops.o" >"$OUT/build-fused_ops.txt" 2>&1 &
  p6=$!
  "$NVCC" $NVFLAGS -c tests/gpu/gpu_check_ops.cu -o "$BUILD/gpu_check_ops.o" >"$OUT/build-check-ops.txt" 2>&1 &
  p7=$!
  # The model's MoE routing rule (standard library only), the reference of the routing kernel.
  g++ -std=c++20 -O2 -Wall -Wextra -I"$ROOT/include" -c src/model/moe_routing.cpp -o "$BUILD/moe_routing.o" \
    >"$OUT/build-moe-routing.txt" 2>&1 &
  p8=$!
  "$NVCC" $NVFLAGS -Xptxas -v -c kernels/cuda/mla_prefill.cu -o "$BUILD/mla_prefill.o" >"$OUT/build-mla_prefill.txt" 2>&1 &
  p9=$!
  "$NVCC" $NVFLAGS -c tests/gpu/gpu_check_prefill.cu -o "$BUILD/gpu_check_prefill.o" >"$OUT/build-check-prefill.txt" 2>&1 &
  p10=$!
  # The project's CPU backend for the cross-backend comparison: no OpenBLAS headers there, so a tiny cblas shim.
  g++ -std=c++20 -O2 -fopenmp -Wall -Wextra -I"$ROOT/include" -I"$ROOT/tests/gpu/shim" \
    -c src/backend/cpu/cpu_backend.cpp -o "$BUILD/cpu_backend.o" >"$OUT/build-cpu-backend.txt" 2>&1
  cpu_rc=$?
  wait $p1; k_rc=$?
  wait $p2; c2_rc=$?
  wait $p3; c3_rc=$?
  if [ $k_rc -ne 0 ]; then
    log "FAILED: kernels/cuda/mla_decode.cu"; tail -n 30 "$OUT/build-mla_decode.txt"; status=1
  else
    if [ $cpu_rc -eq 0 ] && [ $c2_rc -eq 0 ] && "$NVCC" $ARCH "$BUILD/gpu_check_mla_cpu.o" "$BUILD/mla_decode.o" \
         "$BUILD/cpu_backend.o" -o "$BUILD/gpu_check_mla" -lcublas -Xcompiler=-fopenmp >"$OUT/link.txt" 2>&1; then
      BIN="$BUILD/gpu_check_mla"; log "built gpu_check_mla (with the CPU backend comparison)"
    elif [ $c3_rc -eq 0 ] && "$NVCC" $ARCH "$BUILD/gpu_check_mla.o" "$BUILD/mla_decode.o" -o "$BUILD/gpu_check_mla" \
         -lcublas >>"$OUT/link.txt" 2>&1; then
      BIN="$BUILD/gpu_check_mla"; log "built gpu_check_mla WITHOUT the CPU backend comparison (see $OUT/build-*.txt)"
      tail -n 5 "$OUT/build-cpu-backend.txt" "$OUT/build-check-cpu.txt" "$OUT/link.txt" 2>/dev/null
    else
      log "FAILED: gpu_check_mla"; tail -n 30 "$OUT/build-check.txt" "$OUT/link.txt"; status=1
    fi
  fi
  wait $p4; g_rc=$?
  wait $p5; g2_rc=$?
  GEMM_BIN=""
  if [ $g_rc -eq 0 ] && [ $g2_rc -eq 0 ] && "$NVCC" $ARCH "$BUILD/gpu_check_gemm.o" "$BUILD/gemm.o" \
       -o "$BUILD/gpu_check_gemm" -lcublasLt -lcublas >"$OUT/link-gemm.txt" 2>&1; then
    GEMM_BIN="$BUILD/gpu_check_gemm"; log "built gpu_check_gemm"
  else
    log "FAILED: gpu_check_gemm"; tail -n 30 "$OUT/build-gemm.txt" "$OUT/build-check-gemm.txt" "$OUT/link-gemm.txt"
    status=1
  fi
  wait $p6; f_rc=$?
  wait $p7; f2_rc=$?
  wait $p8; r_rc=$?
  OPS_BIN=""
  if [ $f_rc -eq 0 ] && [ $f2_rc -eq 0 ] && [ $r_rc -eq 0 ] && [ $cpu_rc -eq 0 ] && "$NVCC" $ARCH "$BUILD/gpu_check_ops.o" \
       "$BUILD/fused_ops.o" "$BUILD/cpu_backend.o" "$BUILD/moe_routing.o" -o "$BUILD/gpu_check_ops" -Xcompiler=-fopenmp \
       >"$OUT/link-ops.txt" 2>&1; then
    OPS_BIN="$BUILD/gpu_check_ops"; log "built gpu_check_ops"
  else
    log "FAILED: gpu_check_ops"
    tail -n 30 "$OUT/build-fused_ops.txt" "$OUT/build-check-ops.txt" "$OUT/build-moe-routing.txt" \
      "$OUT/build-cpu-backend.txt" "$OUT/link-ops.txt" 2>/dev/null
    status=1
  fi
  wait $p9; pf_rc=$?
  wait $p10; pf2_rc=$?
  PREFILL_BIN=""
  if [ $pf_rc -eq 0 ] && [ $pf2_rc -eq 0 ] && "$NVCC" $ARCH "$BUILD/gpu_check_prefill.o" "$BUILD/mla_prefill.o" \
       -o "$BUILD/gpu_check_prefill" -lcublas >"$OUT/link-prefill.txt" 2>&1; then
    PREFILL_BIN="$BUILD/gpu_check_prefill"; log "built gpu_check_prefill"
    grep -A2 "mla_prefill_fast_kernel" "$OUT/build-mla_prefill.txt" | grep -oE "([0-9]+ bytes stack frame.*|Used.*)" \
      | sed 's/^/mla_prefill_fast_kernel: /' | tee -a "$OUT/gpu-check.log" >/dev/null
  else
    log "FAILED: gpu_check_prefill"
    tail -n 30 "$OUT/build-mla_prefill.txt" "$OUT/build-check-prefill.txt" "$OUT/link-prefill.txt" 2>/dev/null
    status=1
  fi
  log "build took $(( $(date +%s) - start )) s"
  grep -E "registers|spill|smem" "$OUT/build-mla_decode.txt" | sed 's/ptxas info    : //' | paste - - - 2>/dev/null \
    | head -20 >"$OUT/ptxas-summary.txt"
  grep -B1 -E "Used [0-9]+ registers" "$OUT/build-mla_decode.txt" | grep -oE "([0-9]+ bytes stack frame.*|Used.*)" \
    | tee -a "$OUT/gpu-check.log" >/dev/null
fi

# ---- checks + benchmarks ----
if [ -n "$BIN" ]; then
  log "running gpu_check_mla (checks, ceilings, benchmarks)"
  timeout 240 "$BIN" >"$OUT/gpu_check_mla.jsonl" 2>"$OUT/gpu_check_mla.stderr"
  run_rc=$?
  log "gpu_check_mla exit $run_rc"; [ $run_rc -ne 0 ] && status=1
  grep -E '"ok":false|error|fatal' "$OUT/gpu_check_mla.jsonl" | head -20
  tail -n 5 "$OUT/gpu_check_mla.stderr"

  # ---- memory checker on the small cases ----
  SAN=$(command -v compute-sanitizer || ls "$CUDA_BIN/compute-sanitizer" 2>/dev/null || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -n "$SAN" ]; then
    log "compute-sanitizer --tool memcheck gpu_check_mla --quick"
    timeout 120 "$SAN" --tool memcheck --error-exitcode 3 "$BIN" --quick >"$OUT/memcheck.txt" 2>&1
    san_rc=$?
    log "memcheck exit $san_rc: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.txt" | tail -1)"
    [ $san_rc -ne 0 ] && { status=1; grep -m5 -A8 "Invalid\|Error" "$OUT/memcheck.txt"; }
  else
    log "compute-sanitizer not found"
  fi
fi

# ---- GEMM stage (bf16 cuBLAS, FP8 block-scaled; runs whatever happened above) ----
if [ -n "${GEMM_BIN:-}" ]; then
  log "running gpu_check_gemm (checks, cuBLAS bf16 ceiling, V3 shapes)"
  timeout 150 "$GEMM_BIN" >"$OUT/gpu_check_gemm.jsonl" 2>"$OUT/gpu_check_gemm.stderr"
  gemm_rc=$?
  log "gpu_check_gemm exit $gemm_rc"; [ $gemm_rc -ne 0 ] && status=1
  grep -E '"ok":false|error|fatal' "$OUT/gpu_check_gemm.jsonl" | head -20
  tail -n 5 "$OUT/gpu_check_gemm.stderr"
fi

# ---- fused ops + MoE routing/permutation stage (runs whatever happened above) ----
if [ -n "${OPS_BIN:-}" ]; then
  log "running gpu_check_ops (checks vs the CPU backend and the model's routing rule, V3 sizes T=128/8192)"
  timeout 150 "$OPS_BIN" >"$OUT/gpu_check_ops.jsonl" 2>"$OUT/gpu_check_ops.stderr"
  ops_rc=$?
  log "gpu_check_ops exit $ops_rc"; [ $ops_rc -ne 0 ] && status=1
  grep -E '"ok":false|error|fatal' "$OUT/gpu_check_ops.jsonl" | head -20
  tail -n 5 "$OUT/gpu_check_ops.stderr"
  SAN=$(command -v compute-sanitizer || ls "$CUDA_BIN/compute-sanitizer" 2>/dev/null || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -n "$SAN" ]; then
    log "compute-sanitizer --tool memcheck gpu_check_ops --quick"
    timeout 100 "$SAN" --tool memcheck --error-exitcode 3 "$OPS_BIN" --quick >"$OUT/memcheck-ops.txt" 2>&1
    san_rc=$?
    log "memcheck (ops) exit $san_rc: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-ops.txt" | tail -1)"
    [ $san_rc -ne 0 ] && { status=1; grep -m5 -A8 "Invalid\|Error" "$OUT/memcheck-ops.txt"; }
  fi
fi

# ---- MLA prefill attention stage (expanded form, varlen, causal; runs whatever happened above) ----
if [ -n "${PREFILL_BIN:-}" ]; then
  log "running gpu_check_prefill (varlen checks vs float64, V3 H=128 timings vs the cuBLAS bf16 ceiling)"
  timeout 90 "$PREFILL_BIN" >"$OUT/gpu_check_prefill.jsonl" 2>"$OUT/gpu_check_prefill.stderr"
  pre_rc=$?
  log "gpu_check_prefill exit $pre_rc"; [ $pre_rc -ne 0 ] && status=1
  grep -E '"ok":false|error|fatal' "$OUT/gpu_check_prefill.jsonl" | head -20
  tail -n 5 "$OUT/gpu_check_prefill.stderr"
fi

echo
echo "== gpu-check: full output in $OUT =="
grep -h '"kind":"ceiling"\|"kind":"floor"' "$OUT/gpu_check_mla.jsonl" 2>/dev/null | cut -c1-200
grep -h '"kind":"bench"' "$OUT/gpu_check_mla.jsonl" 2>/dev/null \
  | sed -E 's/.*"case":"([^"]*)","variant":"([^"]*)".*"splits":([0-9]+),"median_us":([0-9.]+),"min_us":([0-9.]+),"max_us":([0-9.]+),"gbps":([0-9.]+),"pct_copy":([0-9.]+),"tflops":([0-9.]+),"pct_gemm":([0-9.]+),"max_row_rel_err":([^,]*),.*"ok":([a-z]+).*/\1 \2 s=\3 med=\4 [\5..\6]us \7GB\/s \8% \9TF/' 
grep -h "ERROR SUMMARY" "$OUT/memcheck.txt" 2>/dev/null | tail -1 | sed 's/^/memcheck: /'
sed -n '/^case /,$p' "$OUT/gpu_check_mla.jsonl" 2>/dev/null
echo
echo "== GEMM (FP8 1x128/128x128 block-scaled vs bf16 cuBLAS; DG_H800 = DeepGEMM README, H800) =="
grep -h '"kind":"check"' "$OUT/gpu_check_gemm.jsonl" 2>/dev/null \
  | sed -E 's/.*"case":"([^"]*)","variant":"([^"]*)","path":"([^"]*)".*"rel_err":([^,]*),.*"rel_err_vs_unquantized":([^,]*),.*"ok":([a-z]+).*/check \1 \2 (\3) err=\4 vs_unquant=\5 ok=\6/' \
  | grep '^check' | cut -c1-150
sed -n '/^case /,$p' "$OUT/gpu_check_gemm.jsonl" 2>/dev/null | grep -v '^check '
echo
echo "== fused ops + MoE (bf16 unless named; GB/s of the fewest bytes; floor = bytes / measured copy) =="
grep -h '"ok":false' "$OUT/gpu_check_ops.jsonl" 2>/dev/null | cut -c1-200 | head -10
sed -n '/^case /,$p' "$OUT/gpu_check_ops.jsonl" 2>/dev/null
grep -h "ERROR SUMMARY" "$OUT/memcheck-ops.txt" 2>/dev/null | tail -1 | sed 's/^/memcheck (ops): /'
echo
echo "== MLA prefill (expanded, causal; TFLOPS = 2*H*(192+128)*L(L+1)/2 per sequence / time; %gemm of this run's cuBLAS bf16) =="
grep -h '"ok":false' "$OUT/gpu_check_prefill.jsonl" 2>/dev/null | cut -c1-200 | head -10
grep -h "mla_prefill_fast_kernel" "$OUT/gpu-check.log" 2>/dev/null | tail -2
sed -n '/^case /,$p' "$OUT/gpu_check_prefill.jsonl" 2>/dev/null
echo "gpu-check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
