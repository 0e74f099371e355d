#!/usr/bin/env bash
# Every registered op's small cases (kspec check, fp32 and bf16, NaN-poisoned outputs) under the three
# compute-sanitizer tools: memcheck (out-of-bounds and misaligned accesses), racecheck (shared-memory
# hazards) and initcheck (global memory read before it was written). One process per op and tool, in
# parallel; each is bounded by a timeout. E79's cluster kernels (not the heuristic's choice at these
# batches) are run too with a forced config. Exit 1 if any run reports an error. Results: $OUT/sanitize/.
# Int inputs come from each op's prepare_inputs (difflogic's layers and CA steps: valid wirings and CSRs);
# an op without the generic check (TensorList or int64 data: difflogic's pack, unpack, packed.fwd,
# packed.group_sum) runs no case here: its own GoogleTest suite covers it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
dir="$OUT/sanitize"
mkdir -p "$dir"
LIMIT=${KSPEC_SANITIZE_TIMEOUT:-420}
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
pids=()
for r in "${runs[@]}"; do
  IFS='|' read -r tool op cfg extra <<< "$r"
  name="${tool}_${op}${cfg:+_${cfg//[=,]/_}}"
  (
    # shellcheck disable=SC2086
    timeout "$LIMIT" compute-sanitizer --tool "$tool" --error-exitcode 1 --print-limit 20 \
      python3 -m kspec check --op "$op" $extra ${cfg:+--config "$cfg"} > "$dir/$name.log" 2>&1
    echo $? > "$dir/$name.rc"
  ) &
  pids+=($!)
  while (($(jobs -rp | wc -l) >= ${KSPEC_SANITIZE_JOBS:-12})); do sleep 1; done
done
wait
status=0
printf '%-58s %s\n' "sanitizer run" "result"
for f in "$dir"/*.rc; do
  name=$(basename "$f" .rc)
  rc=$(cat "$f")
  errs=$(grep -m1 -o "ERROR SUMMARY: [0-9]* error[s]*\|RACECHECK SUMMARY: [0-9]* hazard[s]* displayed ([0-9]* error[s]*, [0-9]* warning[s]*)" "$dir/$name.log")
  case $rc in
    0) res="ok ($errs)" ;;
    124) res="TIMEOUT after ${LIMIT}s"; status=1 ;;
    *) res="FAIL rc=$rc ($errs)"; status=1 ;;
  esac
  printf '%-58s %s\n' "$name" "$res"
done | tee "$dir/summary.txt"
grep -q "FAIL\|TIMEOUT" "$dir/summary.txt" && status=1
exit $status
