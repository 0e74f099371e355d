#!/usr/bin/env python3
"""pytest on the GPU machine in parallel shards: the suite's ~2600 GPU tests (float64 references on the
CPU for most of their time) took over 6 minutes for the first fifth serially, past a device call's limit.

  python3 tools/gpu/pytest_shards.py [--shards 8] [--log-dir DIR] [pytest paths and args...]

Collects the test ids once, deals them round-robin to --shards pytest processes (neighbouring ids,
often one parametrized test, spread over every shard), each with OMP_NUM_THREADS = cores / shards, runs
them together and prints each shard's summary, the failures' sections, and the totals. Exits 0 only when
every shard ran and none failed (a shard that errors, or collects nothing, counts as failed). On SIGTERM
or SIGINT (a `timeout`) the shards are killed and each one's last progress line is printed (exit 124).
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--log-dir", default="/tmp/kspec-pytest-shards")
    a, rest = ap.parse_known_args()
    if a.shards < 1:
        ap.error(f"--shards must be at least 1, got {a.shards}")
    paths = rest or ["tests/python"]
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    col = subprocess.run(base + ["--collect-only", "-q"] + paths, capture_output=True, text=True)
    ids = [line.strip() for line in col.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if col.returncode != 0 or not ids:
        print(col.stdout[-4000:], col.stderr[-4000:], sep="\n")
        print(f"pytest_shards: collection failed (exit {col.returncode}, {len(ids)} ids)")
        return 1
    n = min(a.shards, len(ids))
    os.makedirs(a.log_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    procs = []
    t0 = time.time()
    for s in range(n):
        shard = ids[s::n]
        id_file = os.path.join(a.log_dir, f"shard{s}.ids")
        with open(id_file, "w") as f:
            f.write("\n".join(shard) + "\n")
        log = open(os.path.join(a.log_dir, f"shard{s}.log"), "w")
        # the ids on the command line (~100 bytes each); also kept in shardN.ids to rerun one shard
        cmd = base + ["-q", "-rfE"] + shard
        procs.append((s, len(shard), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    print(f"pytest_shards: {len(ids)} tests in {n} shards, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}", flush=True)

    class Stopped(Exception):
        pass

    def stop(signum, _frame):  # raised out of Popen.wait (a wait in the handler would deadlock on its lock)
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    totals, failed_shards = {}, []
    try:
        for s, count, p, log in procs:
            rc = p.wait()
            log.close()
            text = open(log.name).read()
            summary = text.strip().splitlines()[-1] if text.strip() else "(no output)"
            print(f"shard {s} ({count} tests, exit {rc}, {time.time() - t0:.0f} s): {summary}", flush=True)
            for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", summary):
                word = "error" if word.startswith("error") else word
                totals[word] = totals.get(word, 0) + int(num)
            if rc != 0:
                failed_shards.append(s)
                m = re.search(r"^=+ (FAILURES|ERRORS) =+$", text, re.M)
                print(text[m.start():][-20000:] if m else text[-6000:])
    except Stopped as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for s, count, p, log in procs:
            if p.poll() is None:
                p.kill()
        for s, count, p, log in procs:
            p.wait()
            log.close()
            lines = [ln for ln in open(log.name).read().splitlines() if ln.strip()]
            print(f"shard {s} ({count} tests, exit {p.returncode}): {lines[-1] if lines else '(no output)'}")
        print(f"pytest_shards: stopped by signal {e.args[0]} after {time.time() - t0:.0f} s")
        return 124
    ran = sum(totals.get(k, 0) for k in ("passed", "failed", "error", "xpassed", "xfailed", "skipped"))
    print("pytest_shards: " + ", ".join(f"{v} {k}" for k, v in sorted(totals.items())) +
          f" of {len(ids)} collected, in {time.time() - t0:.0f} s")
    if ran != len(ids):
        print(f"pytest_shards: {len(ids) - ran} collected tests did not report a result")
        return 1
    return 1 if failed_shards else 0


if __name__ == "__main__":
    sys.exit(main())
