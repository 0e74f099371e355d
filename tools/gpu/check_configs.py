#!/usr/bin/env python3
"""Every tuning config of an op on chosen cases, each against the float64 reference (GPU).

  python3 tools/gpu/check_configs.py selective_scan.fwd --case base:bf16 --case seqlen_1023:f32 [--match 'algo=sequential.*segs=[248]']

Prints one line per failing (case, dtype, config) and a summary; exits 1 on any failure. The C++ test
GpuEveryOp.EveryTuningConfigMatchesReference does the same for a fixed list over every op; this is the quick
way to check one op's new kernels.
"""
import argparse
import json
import re
import sys

from kspec import _C


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("op", nargs="+")
    ap.add_argument("--case", action="append", required=True, help="CASE:DTYPE")
    ap.add_argument("--match", default="", help="only configs matching this regular expression, e.g. algo=sequential")
    ap.add_argument("--json")
    a = ap.parse_args()
    failed, total, rows = 0, 0, []
    for op in a.op:
        for item in a.case:
            case, dtype = item.split(":")
            if case not in _C.case_names(op):
                continue
            cfgs = [c for c in _C.configs_for_case(op, case, dtype) if not a.match or re.search(a.match, c)]
            if not cfgs:
                continue
            # every config on one draw of inputs, against one float64 reference
            for r in _C.check_op(op, case, [dtype], 0, True, cfgs, 0):
                total += 1
                rows.append(r)
                if not r["passed"]:
                    failed += 1
                    print(f"FAIL {op} {case} {dtype} {r['config']}: {r['message'][:300]}", flush=True)
    print(f"check_configs: {total - failed} passed, {failed} failed ({' '.join(a.op)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
