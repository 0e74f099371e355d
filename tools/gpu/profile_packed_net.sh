#!/usr/bin/env bash
# Counters that say whether difflogic.packed.net's chunked kernel is DRAM-bound or L2-bound (issue 30 (b),
# 2^18 samples, w 32: 12.9 ms ~= 38 GB at 3 TB/s; is the 33 MB of scratch L2-resident?): one network kernel
# per config (tools/gpu/profile_packed_net.py), with DRAM bytes read / written, L2 bytes, L2 hit rates, L2 /
# DRAM / SM throughput as % of peak and the kernel's time. ncu flushes the caches before each profiled
# kernel (its default), as the bench flushes L2 between calls; --clock-control none: the clocks the bench runs at.
#   tools/gpu/profile_packed_net.sh ['CFG;CFG;...'] [probe args, e.g. --w 64 --batch 16384]
# (the network kernels: difflogic_packed_net_kernel, _early_kernel, _fold_kernel; not the ops kernel)
# Output: one line per config on stdout; ncu's raw CSV in $OUT/profile_packed_net.csv. About 30-50 s on the H100.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CONFIGS=${1:-"algo=chunked,chunk=128,inflight=2;algo=early,chunk=128,inflight=2;algo=early_late,chunk=128,inflight=2;algo=chunked,chunk=64,inflight=2;algo=fold,chunk=128,inflight=2"}
shift || true
want=(gpu__time_duration.sum dram__bytes_read.sum dram__bytes_write.sum lts__t_bytes.sum
      lts__t_sector_hit_rate.pct lts__t_sector_op_read_hit_rate.pct lts__t_sector_op_write_hit_rate.pct
      lts__throughput.avg.pct_of_peak_sustained_elapsed dram__throughput.avg.pct_of_peak_sustained_elapsed
      sm__throughput.avg.pct_of_peak_sustained_elapsed lts__t_sectors_srcunit_ltcfabric.sum)
# Only the metrics this ncu knows on this GPU (an unknown one stops the whole run); the L2 fabric (sectors
# crossing between the two L2 partitions) is not on every chip.
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
known=$("$NCU" --query-metrics 2>/dev/null | awk '{print $1}' || true)
metrics=()
for m in "${want[@]}"; do
  # (no list at all: ask for every metric, and let ncu say which one it lacks)
  if [ -z "$known" ] || grep -qx "${m%%.*}" <<<"$known"; then metrics+=("$m"); else echo "(no metric ${m%%.*} here)"; fi
done
csv="$OUT/profile_packed_net.csv"
"$NCU" --clock-control none --kernel-name regex:difflogic_packed_net_ --csv --page raw \
    --metrics "$(IFS=,; echo "${metrics[*]}")" --log-file "$csv" \
    "$PY" tools/gpu/profile_packed_net.py --configs "$CONFIGS" "$@"
# One line per profiled kernel, in the probe's order (its "profiled:" lines above name the configs).
"$PY" - "$csv" "$CONFIGS" <<'PYEOF'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    sys.exit("no ncu rows in " + sys.argv[1] + ":\n" + "\n".join(lines[-20:]))
rows = list(csv.reader(lines[start:]))
head, units, data = rows[0], rows[1], [r for r in rows[2:] if len(r) == len(rows[0])]
cfgs = [c.strip() for c in sys.argv[2].split(";") if c.strip()]
short = {"gpu__time_duration.sum": "time", "dram__bytes_read.sum": "dram rd", "dram__bytes_write.sum": "dram wr",
         "lts__t_bytes.sum": "L2 bytes", "lts__t_sector_hit_rate.pct": "L2 hit%",
         "lts__t_sector_op_read_hit_rate.pct": "L2 rd hit%", "lts__t_sector_op_write_hit_rate.pct": "L2 wr hit%",
         "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 %peak",
         "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %peak",
         "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %peak",
         "lts__t_sectors_srcunit_ltcfabric.sum": "fabric sectors"}
for k, r in enumerate(data):
    out = []
    for col, name in short.items():
        if col not in head:
            continue
        j = head.index(col)
        v, u = r[j].replace(",", ""), units[j]
        try:
            f = float(v)
        except ValueError:
            out.append(f"{name} {v}")
            continue
        if u in ("byte", "Kbyte", "Mbyte", "Gbyte"):
            f *= {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}[u]
            out.append(f"{name} {f / 1e9:.2f} GB")
        elif u in ("nsecond", "usecond", "msecond", "second", "ns", "us", "ms", "s"):  # ncu spells both ways
            f *= {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1, "second": 1e3, "ns": 1e-6, "us": 1e-3, "ms": 1,
                  "s": 1e3}[u]
            out.append(f"{name} {f:.3f} ms")
        elif col.endswith(".sum") and u in ("sector", ""):
            out.append(f"{name} {f * 32 / 1e9:.2f} GB" if u == "sector" else f"{name} {f:g}")
        else:
            out.append(f"{name} {f:.1f}")
    print(f"{cfgs[k] if k < len(cfgs) else '?'}: " + ", ".join(out))
PYEOF
