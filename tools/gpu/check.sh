#!/usr/bin/env bash
# One command for a GPU machine (H100, CUDA 13, torch preinstalled, no network): builds the C++ library
# and the Python package there, runs GoogleTest and pytest with the GPU, the main job (every op against
# its float64 reference), the benchmarks, and prints a results table. Results go to $OUT (or ./gpu-out).
# Stages: check.sh [build] [test] [bench] [sanitize] [sanitize_all] [scan] [scan_small] [e79] [tune] [tune_gemm] (default: build
# test bench; tune includes tune_gemm, which alone tunes only the gemm problems; test is run + ctest +
# pytest, also stages of their own).
set -uo pipefail  # a failing step is recorded, the others still run
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
stages=("$@")
((${#stages[@]})) || stages=(build test bench)
has() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export KSPEC_CACHE_DIR=${KSPEC_CACHE_DIR:-/tmp/kspec-gpu-cache}
export PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1
JOBS=$(nproc)
status=0
summary=()
step() {  # step NAME CMD...: run, log to $OUT/NAME.log, remember pass/fail
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  echo "=== $name: $*" >> "$OUT/log.txt"
  if "$@" 2>&1 | tee -a "$OUT/log.txt"; then
    summary+=("$(printf '%-14s ok    %4ds' "$name" $((SECONDS - t0)))")
  else
    summary+=("$(printf '%-14s FAIL  %4ds' "$name" $((SECONDS - t0)))")
    status=1
  fi
}
pids=() pnames=() pstart=()
pstep() {  # pstep NAME CMD...: like step, in the background (GPU tests overlap: they are CPU-bound)
  local name=$1; shift
  echo "=== $name (background): $*"
  ( "$@" > "/tmp/kspec-step-$name.log" 2>&1 ) &
  pids+=($!) pnames+=("$name") pstart+=($SECONDS)
}
pwait() {  # waits for every pstep, appends their logs in order
  local i
  for i in "${!pids[@]}"; do
    local name=${pnames[$i]}
    if wait "${pids[$i]}"; then
      summary+=("$(printf '%-14s ok    %4ds' "$name" $((SECONDS - pstart[i])))")
    else
      summary+=("$(printf '%-14s FAIL  %4ds' "$name" $((SECONDS - pstart[i])))")
      status=1
    fi
    echo "=== $name" | tee -a "$OUT/log.txt"
    tee -a "$OUT/log.txt" < "/tmp/kspec-step-$name.log" | tail -15
  done
  pids=() pnames=() pstart=()
}
wait_build() {  # wait_build NAME: a peer built in the background (/tmp/NAME_build.log), at most 6 minutes
  [ -f "/tmp/$1_build.log" ] || return 0
  for _ in $(seq 360); do [ -f "/tmp/$1_build.done" ] && break; sleep 1; done
  echo "$1 build: exit $(cat "/tmp/$1_build.done" 2>/dev/null || echo 'not finished')"
  tail -5 "/tmp/$1_build.log"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

# The selective-scan peer builds from source (~150 s, 16 cores) while kspec builds and tests.
if { has bench || has scan || has scan_small || [ -n "${KSPEC_BUILD_PEERS:-}" ]; } && ls .peers/mamba_ssm-*.tar.gz >/dev/null 2>&1 && ! python3 -c "import torch, selective_scan_cuda" 2>/dev/null; then
  setsid nohup bash tools/gpu/build_mamba.sh > /tmp/mamba_build.log 2>&1 < /dev/null &
fi
# The logic-gate peer likewise (~120 s): the difflogic benchmark and test_gpu_surface_families.py use it.
if { has bench || has test || has pytest || [ -n "${KSPEC_BUILD_PEERS:-}" ]; } && ls .peers/difflogic-*.tar.gz >/dev/null 2>&1 && ! python3 -c "import torch, difflogic" 2>/dev/null; then
  setsid nohup bash tools/gpu/build_difflogic.sh > /tmp/difflogic_build.log 2>&1 < /dev/null &
fi

if has build; then
  step cmake cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKSPEC_BUILD_TESTS=ON -DKSPEC_BUILD_BENCH=ON
  step build cmake --build build/gpu -j "$JOBS"
  step pip python3 -m pip install -q --no-build-isolation --no-deps .
  # KSPEC_SKIP_PRECOMPILE=1: quick iterations on one op (CI compiles every specialization anyway)
  [ -n "${KSPEC_SKIP_PRECOMPILE:-}" ] || step precompile python3 -m kspec precompile --all --arch sm_90 --jobs "$JOBS"
fi

if has test; then
  # Cold compile in a fresh cache, then a second process that finds it on disk.
  fresh=$(mktemp -d)
  KSPEC_CACHE_DIR=$fresh python3 -m kspec compile norm_act.fwd --dtype bf16 --arch sm_90 --param hidden=4096 --json \
    > "$OUT/compile_first.json"
  KSPEC_CACHE_DIR=$fresh python3 -m kspec compile norm_act.fwd --dtype bf16 --arch sm_90 --param hidden=4096 --json \
    > "$OUT/compile_second.json"
  echo "first process:  $(cat "$OUT/compile_first.json")"
  echo "second process: $(cat "$OUT/compile_second.json")"
fi
# The test stage's three parts, in parallel; each is also a stage of its own (run, ctest, pytest), so the
# suite can be split over two device calls of at most 10 minutes (H100, precompiled cache: the whole
# ctest took over 6 minutes beside `kspec run --large`).
if has test || has run; then pstep check python3 -m kspec run --large --output "$OUT/check.json"; fi
if has test || has ctest; then pstep ctest bash -c "cd build/gpu && ctest --output-on-failure -j 8"; fi
# pytest in 8 parallel shards (~2600 tests with a GPU, most of their time float64 references on the CPU).
if has test || has pytest; then
  pstep pytest python3 tools/gpu/pytest_shards.py --shards "${KSPEC_PYTEST_SHARDS:-8}" --log-dir /tmp/kspec-pytest-shards \
    tests/python ${KSPEC_PYTEST_ARGS:-}
fi
pwait

if has sanitize; then
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 build/gpu/tests/cpp/kspec_tests \
    --gtest_filter='Ops/GpuEveryOp.EveryCase*:Gpu.ZeroRows'
  step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 build/gpu/tests/cpp/kspec_tests \
    --gtest_filter='Gpu.EveryVisibleDevice'
  # The scan's kernels of both algorithms (shared memory staged by the block, shuffles, atomics).
  for op_cfg in "selective_scan.fwd algo=warp,warps=4,items=8,lanes=1,chunk=32,segs=1" \
                "selective_scan.fwd algo=sequential,warps=4,items=4,lanes=4,chunk=32,segs=1" \
                "selective_scan.bwd algo=warp,warps=4,items=8,lanes=1,chunk=16,segs=1" \
                "selective_scan.bwd algo=sequential,warps=4,items=4,lanes=8,chunk=16,segs=1"; do
    read -r op cfg <<< "$op_cfg"
    name=${op#selective_scan.}_a${cfg:5:1}
    step "memcheck_$name" compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m kspec check --op "$op" \
      --case dim_37 --case seqlen_1023 --case seqlen_2 --dtype bf16 --dtype f32 --config "$cfg"
    step "racecheck_$name" compute-sanitizer --tool racecheck --error-exitcode 1 python3 -m kspec check --op "$op" \
      --case dim_37 --case seqlen_2 --dtype bf16 --config "$cfg"
  done
fi

if has sanitize_all; then
  # Every op's small cases under memcheck, racecheck and initcheck (tools/gpu/sanitize_all.sh).
  step sanitize_all bash tools/gpu/sanitize_all.sh
fi

if has scan_small; then
  # The small Mamba-1 shapes of the outside test (issue 33): kspec against mamba_ssm (gpu and ev columns),
  # where the host time of a training step goes, and every config of the forward and the backward timed
  # at each shape (no database written) to compare with the heuristic's choice.
  SMALL=4x1536x1000,2x4096x333,1x2048x512,16x768x256,8x2560x1024
  wait_build mamba
  step bench_scan_small python3 tools/bench/bench.py --family selective_scan --scan-shapes "$SMALL" \
    --json "$OUT/bench_scan_small.json"
  for shp in 2x4096x333 4x1536x1000; do
    step "profile_$shp" python3 tools/gpu/profile_scan_host.py --shape "$shp" --json "$OUT/profile_$shp.json"
  done
  if [ -z "${KSPEC_SCAN_SMALL_NO_TUNE:-}" ]; then
    mkdir -p "$OUT/scan_tune"
    for shp in ${SMALL//,/ }; do
      IFS=x read -r b d l <<< "$shp"
      for op in fwd bwd; do
        extra=(--without h0); [ $op = bwd ] && extra+=(--without dlast_state)
        step "tune_${op}_$shp" python3 -m kspec tune "selective_scan.$op" --dtype bf16 --param delta_softplus=true \
          "${extra[@]}" --shape "batch=$b,dim=$d,seqlen=$l,dstate=16,groups=1" --budget "${SCAN_TUNE_BUDGET:-15}" \
          --no-save --quiet --output "$OUT/scan_tune/${op}_$shp.json"
      done
    done
    python3 - "$OUT/scan_tune" <<'PY' | tee "$OUT/scan_tune/summary.txt"
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(f))
    ok = sorted((c for c in r["candidates"] if c.get("status") == "ok"), key=lambda c: c["median_ms"])
    print(f"{os.path.basename(f)[:-5]:<22} default {r['default_config']} {r['default_ms']:.4f} ms | best "
          f"{r['best_config']} {r['best_ms']:.4f} ms | next: " + "; ".join(f"{c['config']} {c['median_ms']:.4f}" for c in ok[1:4]))
PY
  fi
fi

if has bench; then
  # Peers carried as wheels (no network there): .peers/*.whl, e.g. liger-kernel, mlstm-kernels and einops
  # (tools/bench/README.md).
  if ls .peers/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  [ -x build/gpu/tools/bench/kspec_dispatch_bench ] || cmake --build build/gpu -j "$JOBS" --target kspec_dispatch_bench
  # Every family of `bench.py --list` (a file under tools/bench that sets FAMILY), a step bench_<family>
  # each with its JSON; a family's extra options from KSPEC_BENCH_<FAMILY>_ARGS (e.g. KSPEC_BENCH_E79_ARGS);
  # a family that is also a stage of this run (e79) is benched there; one whose peer is built above waits
  # for that build first.
  if families=$(python3 tools/bench/bench.py --list); then
    while read -r -u 3 fam needs _; do  # fd 3: a benchmark reading stdin cannot eat the list
      has "$fam" && continue
      [ "$needs" != - ] && wait_build "$needs"
      extra_var="KSPEC_BENCH_${fam^^}_ARGS"
      # shellcheck disable=SC2086  # the extra options are words
      step "bench_$fam" python3 tools/bench/bench.py --family "$fam" \
        --dispatch-bin build/gpu/tools/bench/kspec_dispatch_bench --json "$OUT/bench_$fam.json" ${!extra_var:-}
    done 3<<< "$families"
  else
    summary+=("$(printf '%-14s FAIL  %4ds' bench_list 0)")
    status=1
  fi
fi

if has e79; then
  # E79's kernels, the cluster-split ones (one sequence over 2/4/8 CTAs, sm_90) in particular: every config
  # against the float64 reference on the cases where clusters matter, the E79 GoogleTests and pytest
  # files, the cluster kernels under memcheck and racecheck, then the benchmark (a row per cluster size
  # for B = 1 and 16). Quick: KSPEC_BENCH_E79_ARGS="--B 1 16 --no-compile".
  step e79_configs python3 tools/gpu/check_configs.py e79.fwd e79.bwd --case base:bf16 --case B_1_n_8:f32 \
    --case B_1_n_128:bf16 --case B_1_n_64_T_not_multiple_of_K:f32 --case n_48:f32 --case n_96:bf16 \
    --case chunk_1:f32 --case T_1_B_1:f32 --json "$OUT/e79_configs.json"
  step e79_gtest build/gpu/tests/cpp/kspec_tests --gtest_filter='E79*:Ops/GpuEveryOp.EveryTuningConfigMatchesReference/e79*'
  step e79_pytest python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu_e79.py tests/python/test_e79_nn.py \
    tests/python/test_e79_custom_op.py
  step e79_memcheck compute-sanitizer --tool memcheck --error-exitcode 1 build/gpu/tests/cpp/kspec_tests \
    --gtest_filter='E79Gpu.ProjectedThroughGemmWithClusters'
  step e79_racecheck compute-sanitizer --tool racecheck --error-exitcode 1 build/gpu/tests/cpp/kspec_tests \
    --gtest_filter='E79Gpu.ProjectedThroughGemmWithClusters'
  # Every legal (split, cluster) config timed at small-batch points, T = 4096, bf16; --no-save keeps the
  # tuning database (and so the benchmark's default row: the heuristic, one CTA per sequence) unchanged.
  mkdir -p "$OUT/e79_tune"
  for op in fwd bwd; do
    for bn in 1,64 16,64 1,128 16,128 1,32; do
      IFS=, read -r b n <<< "$bn"
      name="${op}_${b}x4096_n$n"
      step "tune_e79_$name" python3 -m kspec tune "e79.$op" --dtype bf16 --alt-shape b_s --alt-shape b_m \
        --shape "seqlen=4096,batch=$b,n=$n,nchk=256" --all-configs --no-save --quiet \
        --report "$OUT/e79_tune/$name" --output "$OUT/e79_tune/$name.result.json"
    done
  done
  python3 - "$OUT/e79_tune" <<'PY' | tee "$OUT/e79_tune/summary.txt" | tee -a "$OUT/log.txt"
import glob, json, os, sys
print(f"{'problem':<22} {'default (1 CTA)':<20} {'ms':>9} {'best config':<22} {'ms':>9} {'gain':>6}  best with cluster > 1")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.result.json"))):
    r = json.load(open(f))
    ok = [c for c in r["candidates"] if c.get("status") == "ok"]
    cl = min((c for c in ok if "cluster=1" not in c["config"]), key=lambda c: c["median_ms"], default=None)
    name = os.path.basename(f)[:-len(".result.json")]
    if r["default_ms"] > 0 and r["best_ms"] > 0:
        print(f"{name:<22} {r['default_config']:<20} {r['default_ms']:9.3f} {r['best_config']:<22} {r['best_ms']:9.3f}"
              f" {r['default_ms'] / r['best_ms']:5.2f}x  " + (f"{cl['config']} {cl['median_ms']:.3f} ms" if cl else "-"))
    bad = [c for c in r["candidates"] if c.get("status") not in ("ok", "pruned", "not timed")]
    for c in bad:
        print(f"  {name}: {c['config']}: {c['status']} {c.get('why', '')}")
PY
  # shellcheck disable=SC2086
  step bench_e79 python3 tools/bench/bench.py --family e79 --json "$OUT/bench_e79.json" ${KSPEC_BENCH_E79_ARGS:-}
fi

if has scan; then
  # The selective scan's algo-1 kernels: every config on edge cases against float64, the checker (every
  # case, heuristic configs; --large took over 6 minutes of float64 references on the host), every
  # backward config timed at 8x2048x2048 (kspec tune), the benchmark against mamba_ssm.
  # One process per case in parallel (the compiles and float64 references are CPU-bound); segment
  # counts > 1 are legal only where a segment holds 4 chunks, so the long cases carry them.
  C=(base:bf16 batch_1:f32 seqlen_1:f32 seqlen_2:f32 seqlen_1023:f32 dim_37:f32 dstate_1:f32 dstate_4:bf16
     dstate_64:f32 groups_4:bf16 fixed_bc:f32 fixed_b:f32 no_z:bf16 no_softplus:f32 none_optional:f32
     wide_8x1024:bf16 wide_even_8x1024:bf16 bc_fp32:bf16 seqlen_even_1024:f16 segments_2x32x9000:bf16
     segments_2x32x9000:f32 segments_even_2x32x8192:bf16 segments_even_2x32x8192:f32)
  step scan_configs bash -c 'printf "%s\n" "$@" | xargs -P 12 -I{} python3 tools/gpu/check_configs.py \
    selective_scan.bwd selective_scan.fwd --match algo=sequential --case {}' _ "${C[@]}"
  step scan_check python3 -m kspec check --op selective_scan.fwd --op selective_scan.bwd --output "$OUT/scan_check.json"
  KSPEC_TUNING_DB=/tmp/scan-tune.json step scan_tune_bwd python3 -m kspec tune selective_scan.bwd --dtype bf16 \
    --param delta_softplus=true --without h0 --without dlast_state --budget 60 \
    --shape batch=8,dim=2048,seqlen=2048,dstate=16,groups=1 --output "$OUT/scan_tune_bwd.json"
  wait_build mamba
  step bench_selective_scan python3 tools/bench/bench.py --family selective_scan --json "$OUT/bench_selective_scan.json"
fi

if has tune || has tune_gemm; then
  # Tune norm_act and selective_scan (about 60 s each) and gemm, into a database under $OUT; reports
  # (PNG, CSV, JSON) per problem; the summary prints default vs tuned time for each.
  export KSPEC_TUNING_DB="$OUT/tuning"
  mkdir -p "$OUT/tune"
  BUDGET=${TUNE_BUDGET:-40}  # seconds per problem; 8 problems (+3 gemm)
  tune_one() {  # tune_one NAME OP ARGS...
    local name=$1; shift
    step "tune_$name" python3 -m kspec tune "$@" --budget "$BUDGET" --report "$OUT/tune/$name" --output "$OUT/tune/$name.result.json"
  }
fi
if has tune; then
  NA=(--dtype bf16 --param norm=rmsnorm --param act=silu)
  tune_one norm_fwd_16384x4096 norm_act.fwd "${NA[@]}" --shape rows=16384,hidden=4096
  tune_one norm_bwd_16384x4096 norm_act.bwd "${NA[@]}" --shape rows=16384,hidden=4096
  tune_one norm_fwd_16384x1024 norm_act.fwd "${NA[@]}" --shape rows=16384,hidden=1024
  tune_one norm_fwd_16384x12289 norm_act.fwd "${NA[@]}" --shape rows=16384,hidden=12289
  SS=(--dtype bf16 --param delta_softplus=true)
  for bds in 8,2048,2048 1,2048,4096; do
    IFS=, read -r b d l <<< "$bds"
    tune_one "scan_fwd_${b}x${d}x${l}" selective_scan.fwd "${SS[@]}" --without h0 \
      --shape batch=$b,dim=$d,seqlen=$l,dstate=16,groups=1
    tune_one "scan_bwd_${b}x${d}x${l}" selective_scan.bwd "${SS[@]}" --without h0 --without dlast_state \
      --shape batch=$b,dim=$d,seqlen=$l,dstate=16,groups=1
  done
fi
if has tune || has tune_gemm; then
  # gemm: cuBLASLt's 16 best heuristic candidates per problem (bf16, bias, no saved pre-activation): the
  # large square-ish one, and the skinny K=33 one with bias+gelu whose heuristic choice ran at 6 TFLOP/s;
  # gemm.bwd tunes dx's and dW's algorithms. Then tune_gemm_check: explain reports the tuned algorithm,
  # dispatch vs the heuristic vs torch timed, outputs against float64 ($OUT/tune/gemm_dispatch.json).
  GM=(--dtype bf16 --without aux --candidates 16)
  tune_one gemm_16384x4096x4096_bias gemm "${GM[@]}" --shape m=16384,n=4096,k=4096
  tune_one gemm_4097x4095x33_bias_gelu gemm "${GM[@]}" --param act=gelu --shape m=4097,n=4095,k=33
  tune_one gemm_bwd_16384x4096x4096_gelu gemm.bwd --dtype bf16 --param act=gelu --candidates 8 \
    --shape m=16384,n=4096,k=4096
  step tune_gemm_check python3 tools/gpu/tune_gemm_check.py --shape 16384,4096,4096 --shape 4097,4095,33:gelu \
    --json "$OUT/tune/gemm_dispatch.json"
  python3 -m kspec tune --list --output "$OUT/tune/db_entries.json" | tee -a "$OUT/log.txt"
  python3 - "$OUT/tune" <<'PY' | tee "$OUT/tune/summary.txt" | tee -a "$OUT/log.txt"
import glob, json, os, sys
print(f"{'problem':<28} {'default config':<48} {'ms':>8} {'tuned config':<48} {'ms':>8} {'gain':>6}")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.result.json"))):
    r = json.load(open(f))
    name = os.path.basename(f)[:-len(".result.json")]
    if r["default_ms"] > 0 and r["best_ms"] > 0:
        print(f"{name:<28} {r['default_config'] or '(heuristic)':<48} {r['default_ms']:8.4f}"
              f" {r['best_config'] or '(heuristic)':<48} {r['best_ms']:8.4f}"
              f" {r['default_ms'] / r['best_ms']:5.2f}x")
PY
  unset KSPEC_TUNING_DB
fi

echo
echo "=== kspec GPU check summary ($(head -2 "$OUT/gpu.txt" | tail -1))"
printf '%s\n' "${summary[@]}"
grep -h "passed\|failed\|tests passed" "$OUT/log.txt" 2>/dev/null | tail -6
exit $status
