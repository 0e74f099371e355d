#!/usr/bin/env bash
# Every registered op's small cases (kspec check, fp32 and bf16, NaN-poisoned outputs) under the three
# compute-sanitizer tools: memcheck (out-of-bounds and misaligned accesses), racecheck (shared-memory
# hazards) and initcheck (global memory read before it was written). One process per op and tool, in
# parallel; each is bounded by a timeout. E79's cluster kernels (not the heuristic's choice at these
# batches) are run too with a forced config. Exit 1 if any run reports an error. Results: $OUT/sanitize/,
# and in the summary the tail of every run that did not pass (its log may not come back).
# Int inputs come from each op's prepare_inputs (difflogic's layers and CA steps: valid wirings and CSRs);
# an op without the generic check (TensorList or int64 data: difflogic's pack, unpack, packed.fwd,
# packed.group_sum) runs no case here: its own GoogleTest suite covers it.
# A run's exit code says who failed: the sanitizer's own (SANITIZER_RC) when it found errors, else kspec
# check's (1: a case did not match the float64 reference; 4: a CUDA error; ...). One seed for every run
# (KSPEC_SANITIZE_SEED), so a failing case reruns with the same inputs: `kspec check` otherwise draws
# fresh inputs per process. initcheck_mhc.pre.bwd's "exit 1, 0 errors" on the H100 was kspec check's own
# exit code 1 (a case off the reference, on inputs no other run drew): with --error-exitcode 1 it read
# like the sanitizer's.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
dir="$OUT/sanitize"
mkdir -p "$dir"
LIMIT=${KSPEC_SANITIZE_TIMEOUT:-420}
SEED=${KSPEC_SANITIZE_SEED:-34}
SANITIZER_RC=86  # not one of kspec's exit codes (kspec --help lists them)
# KSPEC_SANITIZE_OPS: a regular expression selecting ops (default: every op, and E79's cluster runs)
ops=$(python3 -c "import kspec, os, re; pat = os.environ.get('KSPEC_SANITIZE_OPS', ''); print(' '.join(o for o in kspec.list_ops() if re.search(pat, o)))")
runs=()
for op in $ops; do
  # racecheck is the slowest tool (minutes for e79 and the scan's backward): one dtype; shared memory
  # is fp32 in every kernel whatever the dtype.
  runs+=("memcheck|$op||--dtype f32 --dtype bf16" "initcheck|$op||--dtype f32 --dtype bf16" "racecheck|$op||--dtype bf16")
done
# E79's cluster kernels, sm_90: one sequence over 2 and 4 CTAs (B = 1 cases where n * split / cluster
# threads are whole warps).
[ -n "${KSPEC_SANITIZE_OPS:-}" ] && ! [[ e79.fwd =~ $KSPEC_SANITIZE_OPS ]] && cluster_cfgs=() || cluster_cfgs=(split=4,cluster=2 split=8,cluster=4)
for cfg in "${cluster_cfgs[@]}"; do
  for op in e79.fwd e79.bwd; do
    for tool in memcheck racecheck initcheck; do
      runs+=("$tool|$op|$cfg|--dtype f32 --case B_1_n_128 --case B_1_n_64_T_not_multiple_of_K --case T_1_B_1")
    done
  done
done
# KSPEC_SANITIZE_EXTRA: more runs, "tool|op|config|kspec check arguments" separated by ';' (configs that are
# no heuristic's choice at the small cases: a new kernel's own config, say)
if [ -n "${KSPEC_SANITIZE_EXTRA:-}" ]; then
  IFS=';' read -r -a extra_runs <<< "$KSPEC_SANITIZE_EXTRA"
  runs+=("${extra_runs[@]}")
fi
pids=()
for r in "${runs[@]}"; do
  IFS='|' read -r tool op cfg extra <<< "$r"
  name="${tool}_${op}${cfg:+_${cfg//[=,]/_}}"
  (
    # shellcheck disable=SC2086
    timeout "$LIMIT" compute-sanitizer --tool "$tool" --error-exitcode $SANITIZER_RC --print-limit 20 \
      python3 -m kspec check --op "$op" --seed "$SEED" $extra ${cfg:+--config "$cfg"} > "$dir/$name.log" 2>&1
    echo $? > "$dir/$name.rc"
  ) &
  pids+=($!)
  while (($(jobs -rp | wc -l) >= ${KSPEC_SANITIZE_JOBS:-12})); do sleep 1; done
done
wait
status=0
printf '%-58s %s\n' "sanitizer run (seed $SEED)" "result"
for f in "$dir"/*.rc; do
  name=$(basename "$f" .rc)
  rc=$(cat "$f")
  errs=$(grep -m1 -o "ERROR SUMMARY: [0-9]* error[s]*\|RACECHECK SUMMARY: [0-9]* hazard[s]* displayed ([0-9]* error[s]*, [0-9]* warning[s]*)" "$dir/$name.log")
  case $rc in
    0) res="ok ($errs)" ;;
    2) if grep -q "ran no case" "$dir/$name.log"; then res="none: no generic case (the op's own GPU tests check it)"; rc=0
       else res="FAIL: kspec check rc=2 ($errs)"; status=1; fi ;;
    124) res="TIMEOUT after ${LIMIT}s"; status=1 ;;
    "$SANITIZER_RC") res="FAIL: sanitizer errors ($errs)"; status=1 ;;
    1) res="FAIL: kspec check found mismatches, rc=1 ($errs)"; status=1 ;;
    *) res="FAIL: kspec check rc=$rc ($errs)"; status=1 ;;
  esac
  printf '%-58s %s\n' "$name" "$res"
  # the cause in the summary itself: the failing rows (FAIL ... seed) or the sanitizer's report end
  [ "$rc" = 0 ] || { grep "FAIL" "$dir/$name.log" | head -n 8; tail -n 12 "$dir/$name.log"; } | sed 's/^/    | /'
done | tee "$dir/summary.txt"
grep -q "^[^ ].*\(FAIL\|TIMEOUT\)" "$dir/summary.txt" && status=1
exit $status
