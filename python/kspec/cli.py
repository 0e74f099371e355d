"""The kspec command line: ops, compile, precompile, cache, doctor, check, run, tune."""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time

from . import _C


def _console():
    try:
        from rich.console import Console

        return Console()
    except ImportError:
        return None


def _table(title, columns, rows):
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in columns:
            t.add_column(c)
        for r in rows:
            t.add_row(*[str(x) for x in r])
        Console(width=200).print(t)
    except ImportError:
        print(title)
        print("  ".join(columns))
        for r in rows:
            print("  ".join(str(x) for x in r))


def _parse_value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        return v


def _kv(items, what):
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"kspec: {what} expects name=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = _parse_value(v)
    return out


def cmd_ops(a):
    names = [a.name] if a.name else _C.list_ops()
    if a.json:
        print(json.dumps([_C.op_info(n) for n in names], indent=2))
        return 0
    for n in names:
        print(_C.describe_op(n))
    return 0


def _compile_one(req):
    return _C.compile(req["op"], req["dtype"], req["arch"], req.get("params", {}), req.get("without", []),
                      req.get("tensor_dtypes", {}), req.get("config"), req.get("alt_shapes", []))


def cmd_compile(a):
    req = {"op": a.op, "dtype": a.dtype, "arch": a.arch, "params": _kv(a.param, "--param"),
           "without": a.without or [], "tensor_dtypes": {k: str(v) for k, v in _kv(a.tensor_dtype, "--tensor-dtype").items()},
           "config": a.config, "alt_shapes": a.alt_shape or []}
    reports = _compile_one(req)
    if a.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2 if a.verbose else None))
        return 0
    for r in reports:
        print(f"{r['kernel']}\n  key {r['key']}\n  {r['source']} in {r['load_ms']:.1f} ms"
              f" (compile {r['compile_ms']:.1f} ms), {r['registers']} registers, {r['spill_bytes']} B spill,"
              f" {r['shared_bytes']} B static smem, arch {r['arch']}, config {r['config']}\n  {r['path'] or '(memory only)'}")
        if a.verbose and r["log"]:
            print("  " + r["log"].replace("\n", "\n  "))
    return 0


# A spec list is a few thousand requests at most; a larger file is refused before it is read.
_MAX_SPEC_LIST_BYTES = 16 << 20


def _load_requests(path):
    """Compile requests from a JSON list or JSON lines; InvalidArgument for anything else (too large,
    nested too deep for the parser, not objects)."""
    what = f"kspec precompile --file {path}"
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_SPEC_LIST_BYTES + 1)
    except OSError as e:
        raise _C.InvalidArgument(f"{what}: cannot read it ({e.strerror})") from None
    if len(data) > _MAX_SPEC_LIST_BYTES:
        raise _C.InvalidArgument(f"{what}: larger than {_MAX_SPEC_LIST_BYTES} bytes; expected a list of compile requests")
    try:
        text = data.decode("utf-8").strip()
        if text.startswith("["):
            reqs = json.loads(text)
        else:
            reqs = [json.loads(line) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
        raise _C.InvalidArgument(f"{what}: not JSON lines or a JSON list of compile requests ({type(e).__name__}:"
                                 f" {str(e)[:200]})") from None
    if not isinstance(reqs, list) or not all(isinstance(r, dict) for r in reqs):
        raise _C.InvalidArgument(f"{what}: expected compile requests as JSON objects ({{\"op\": ..., \"dtype\": ...}})")
    for r in reqs:
        r.setdefault("arch", "sm_90")
        r.setdefault("dtype", "f32")
    return reqs


def cmd_precompile(a):
    archs = a.arch or ["sm_80", "sm_90"]
    if a.all:
        reqs = _C.precompile_plan(archs, a.op or [])
    elif a.file:
        reqs = _load_requests(a.file)
    else:
        raise SystemExit("kspec precompile: give --all or --file FILE (JSON lines of compile requests)")
    jobs = a.jobs or _C.compile_threads()
    results, failures = [], []
    t0 = time.time()
    try:
        from rich.progress import Progress
        progress = Progress(transient=False)
    except ImportError:
        progress = None

    def run(req):
        try:
            return req, _compile_one(req), None
        except Exception as e:  # report every failure, keep going
            return req, None, e

    with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = [pool.submit(run, r) for r in reqs]
        task = progress.add_task("compiling", total=len(futs)) if progress else None
        if progress:
            progress.start()
        try:
            for fut in cf.as_completed(futs):
                req, reports, err = fut.result()
                if err is not None:
                    failures.append((req, f"{type(err).__name__}: {err}"))
                else:
                    for r in reports:
                        results.append(r)
                        if r["spill_bytes"] and r["spill_bytes"] > 0:
                            failures.append((req, f"{r['kernel']} spills {r['spill_bytes']} bytes ({r['arch']})"))
                if progress:
                    progress.advance(task)
        finally:
            if progress:
                progress.stop()
    dt = time.time() - t0
    by_source = {}
    for r in results:
        by_source[r["source"]] = by_source.get(r["source"], 0) + 1
    worst = max(results, key=lambda r: r["registers"], default=None)
    print(f"kspec precompile: {len(reqs)} requests, {len(results)} kernels ({by_source}) for {archs} in {dt:.1f} s"
          f" with {jobs} threads" + (f"; most registers: {worst['registers']} ({worst['kernel']})" if worst else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "failures": [[r, e] for r, e in failures]}, f, indent=1)
    for req, err in failures[:20]:
        print(f"FAILED {json.dumps(req)}\n  {err}", file=sys.stderr)
    if failures:
        print(f"kspec precompile: {len(failures)} failure(s)", file=sys.stderr)
        return 1
    return 0


def cmd_cache(a):
    try:
        return _cache_action(a)
    except _C.CacheError as e:  # a read-only or foreign directory: say so, no traceback
        print(f"kspec: CacheError: {e}", file=sys.stderr)
        return 1


def _cache_action(a):
    if a.action == "stats":
        s = _C.cache_stats()
        print(json.dumps(s, indent=2) if a.json else
              f"{s['dir']}: {s['entries']} entries, {s['bytes']} bytes (cap {s['max_bytes']}),"
              f" {'enabled' if s['enabled'] else 'disabled'}, {'writable' if s['writable'] else 'read-only'}")
    elif a.action == "list":
        entries = _C.cache_entries()
        if a.json:
            print(json.dumps(entries, indent=1))
        else:
            _table("kspec cache", ["key", "kernel", "arch", "regs", "spill", "smem", "bytes", "compile ms"],
                   [[e["key"][:16], e["kernel"][:70], e["arch"], e["registers"], e["spill_bytes"], e["shared_bytes"],
                     e["bytes"], f"{e['compile_ms']:.0f}"] for e in entries])
    elif a.action == "verify":
        ok, bad = _C.cache_verify()
        removed = sum(1 for b in bad if b.endswith("(removed)"))
        print(f"{ok} entries ok, {len(bad)} bad ({removed} removed)")
        for b in bad:
            print("  " + b)
        return 1 if bad else 0
    elif a.action == "prune":
        n = _C.cache_prune(a.max_bytes if a.max_bytes is not None else -1)
        print(f"pruned {n} entries")
    elif a.action == "clear":
        print(f"removed {_C.cache_clear()} entries")
    return 0


def cmd_doctor(a):
    facts = _C.doctor()
    if a.json:
        print(json.dumps(dict(facts), indent=2))
    else:
        width = max(len(k) for k, _ in facts)
        for k, v in facts:
            print(f"{k:<{width}}  {v}")
    return 0


def _gpu_count():
    facts = dict(_C.doctor())
    try:
        return int(facts.get("gpus", "0"))
    except ValueError:
        return 0


def cmd_check(a):
    if _gpu_count() == 0:
        print("kspec check: no GPU visible; nothing to run (kspec precompile --all compiles everything without one)")
        return 2
    ops = a.op or _C.list_ops()
    rows, ok = [], True
    all_results = []
    for op in ops:
        res = [r for case in (a.case or [""])
               for r in _C.check_op(op, case, a.dtype or [], a.device, a.large, a.config, a.seed)]
        for r in res:
            all_results.append(r)
            ok = ok and r["passed"]
            errs = " ".join(f"{n}={e:.1e}" for n, e in r["errors"])
            rows.append([r["op"], r["case"], r["dtype"], r["shape"], r["config"], errs, f"{r['tolerance']:.0e}",
                         "ok" if r["passed"] else "FAIL " + r["message"][:80]])
    _table("kspec check: GPU vs float64 reference (relative error ‖out−ref‖/‖ref‖)",
           ["op", "case", "dtype", "dims", "config", "errors", "tol", "result"], rows)
    passed = sum(1 for r in all_results if r["passed"])
    print(f"{passed} passed, {len(all_results) - passed} failed")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(all_results, f, indent=1)
    return 0 if ok else 1


def cmd_run(a):
    """The main job: on a GPU, every op against its reference; without one, compile everything."""
    if _gpu_count() > 0:
        return cmd_check(argparse.Namespace(op=None, case=None, dtype=None, device=0, large=a.large, config=None,
                                            seed=0, json=a.json))
    print("kspec run: no GPU visible — specializing and compiling every op into the cache instead")
    return cmd_precompile(argparse.Namespace(all=True, file=None, arch=a.arch or ["sm_80", "sm_90"], op=None,
                                             jobs=None, json=a.json))


def _shape(items):
    out = {}
    for item in items or []:
        for part in item.split(","):
            if part.strip():
                out.update(_kv([part.strip()], "--shape"))
    return out


def _fmt_ms(v):
    return f"{v:.4f}" if v and v > 0 else "-"


def _tune_progress():
    """A rich progress bar (compile, then time), or plain lines; returns (callback, stop)."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[last]}"), transient=False)
        tasks = {}
        prog.start()

        def cb(phase, done, total, cand):
            if phase not in tasks:
                tasks[phase] = prog.add_task("compiling" if phase == "compile" else "timing", total=total, last="")
            last = ""
            if cand is not None:
                last = f"{cand['config']}: " + (f"{cand['median_ms']:.4f} ms" if cand["median_ms"] > 0 else cand["status"])
            prog.update(tasks[phase], completed=done, total=total, last=last)

        return cb, prog.stop
    except ImportError:
        state = {"phase": None}

        def cb(phase, done, total, cand):
            if phase != state["phase"]:
                state["phase"] = phase
                print(f"kspec tune: {'compiling' if phase == 'compile' else 'timing'} {total} configurations")
            if phase == "time" and cand is not None:
                t = f"{cand['median_ms']:.4f} ms" if cand["median_ms"] > 0 else cand["status"]
                print(f"  [{done}/{total}] {cand['config']}: {t}", flush=True)

        return cb, lambda: None


def cmd_tune(a):
    from . import tuning

    if a.db:
        print(tuning.db_path(a.device))
        return 0
    if a.export_file:
        n = tuning.export_db(a.export_file)
        print(f"kspec tune: exported {n} entries from {tuning.db_path(a.device)} to {a.export_file}")
        return 0
    if a.import_file:
        n = tuning.import_db(a.import_file)
        print(f"kspec tune: merged {n} entries from {a.import_file}")
        return 0
    if a.list:
        entries = tuning.db_entries()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(entries, f, indent=1)
        _table(f"kspec tuning database: {tuning.db_path(a.device)}",
               ["op", "shape", "bucket", "config", "ms", "default ms", "speedup", "updated"],
               [[e.get("op", ""), e.get("shape", ""), e.get("bucket", ""), e.get("config", ""), _fmt_ms(e.get("time_ms")),
                 _fmt_ms(e.get("default_ms")), f"{e.get('speedup', 0):.2f}x", e.get("updated", "")]
                for e in entries.values()])
        return 0
    if not a.op:
        raise SystemExit("kspec tune: give an OP (or --list, --export FILE, --import FILE, --db)")
    params = _kv(a.param, "--param")
    shape = _shape(a.shape)
    info = _C.op_info(a.op)
    dims = [d["name"] for d in info["dims"]]
    for name in shape:
        if name not in dims:
            raise SystemExit(f"kspec tune: {a.op} has no dim {name!r} (its dims: {', '.join(dims)}; scalar params such"
                             f" as {', '.join(p['name'] for p in info['params']) or 'none'} go in --param)")
    if a.candidates < 1:
        raise SystemExit(f"kspec tune: --candidates must be at least 1, got {a.candidates}")
    cb, stop = _tune_progress() if not a.quiet else (None, lambda: None)
    try:
        r = tuning.tune(a.op, a.dtype, shape, budget=a.budget, all_configs=a.all_configs, device=a.device,
                        arch=a.arch, without=a.without or [], alt_shapes=a.alt_shape or [],
                        tensor_dtypes={k: str(v) for k, v in _kv(a.tensor_dtype, "--tensor-dtype").items()},
                        compile_only=a.compile_only, write_db=not a.no_save, batches=a.batches, seed=a.seed,
                        progress=cb, candidates=a.candidates, **params)
    finally:
        stop()
    rows = tuning.table_rows(r, include_pruned=a.all_configs)
    flops = tuning.flops(r)
    _table(f"kspec tune {r['op']} {r['shape']} ({r['gpu']}, {r['arch']})",
           ["config", "status", "median ms", "min ms", "vs default", "rel. diff", "regs", "spill", "smem", "note"]
           + (["TFLOP/s"] if flops else []),
           [[tuning.config_label(r, c["config"]) + (" (default)" if c["default"] else ""), c["status"],
             _fmt_ms(c["median_ms"]), _fmt_ms(c["min_ms"]), f"{c['speedup']:.2f}x" if c["speedup"] > 0 else "-",
             f"{c['error']:.1e}" if c["error"] >= 0 else "-", c["registers"], c["spill_bytes"], c["shared_bytes"],
             c["why"][:60]] + ([f"{c['tflops']:.0f}" if c.get("tflops", -1) > 0 else "-"] if flops else [])
            for c in rows])
    counts = {}
    for c in r["candidates"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    print(f"configurations: {len(r['candidates'])} ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))})"
          f" in {r['seconds']:.1f} s")
    if r.get("note"):
        print(r["note"])
    if r["timed"]:
        print(f"default {tuning.config_label(r, r['default_config'])}: {r['default_ms']:.4f} ms;"
              f" best {tuning.config_label(r, r['best_config'])}: {r['best_ms']:.4f} ms"
              f" ({r['default_ms'] / r['best_ms']:.2f}x); {r['input_sets']} input sets rotated,"
              f" {r['batch_calls']} calls per timed batch")
        print(f"tuning database: {r['db_path']}" + (" (written)" if r["written"] else " (not written)"))
        print(f"  key: {r['key']}")
    else:
        print("no GPU (or --compile-only): pruned and compiled only, nothing timed or recorded")
    if a.report:
        for path in tuning.write_report(r, a.report):
            print(f"wrote {path}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kspec", description="JIT kernel specialization for sequence models")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("ops", help="the registry with schemas")
    s.add_argument("name", nargs="?")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_ops)

    s = sub.add_parser("compile", help="specialize + compile one op (no GPU needed)")
    s.add_argument("op")
    s.add_argument("--dtype", default="f32")
    s.add_argument("--arch", default="sm_90")
    s.add_argument("--param", action="append", metavar="K=V", help="params and compile-time dims, e.g. hidden=4096")
    s.add_argument("--without", action="append", metavar="INPUT", help="leave out an optional input")
    s.add_argument("--alt-shape", action="append", metavar="INPUT",
                   help="give an input in its alternative shape (e.g. a fixed B [dim, dstate])")
    s.add_argument("--tensor-dtype", action="append", metavar="NAME=DTYPE")
    s.add_argument("--config", help="tuning config, e.g. threads_per_row=256,rows_per_block=1,vec=8,stream=0")
    s.add_argument("--json", action="store_true")
    s.add_argument("--verbose", "-v", action="store_true")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser("precompile", help="compile a list of specializations (--all: every op x dtype x config)")
    s.add_argument("--all", action="store_true")
    s.add_argument("--file")
    s.add_argument("--arch", action="append")
    s.add_argument("--op", action="append")
    s.add_argument("--jobs", type=int)
    s.add_argument("--json", metavar="FILE")
    s.set_defaults(fn=cmd_precompile)

    s = sub.add_parser("cache", help="the disk cache")
    s.add_argument("action", choices=["stats", "list", "verify", "prune", "clear"])
    s.add_argument("--max-bytes", type=int)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_cache)

    s = sub.add_parser("doctor", help="driver, toolkit, NVRTC, GPUs, cache directory")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_doctor)

    for name, fn, hlp in (("check", cmd_check, "every op on the GPU against its float64 reference"),):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("--op", action="append")
        s.add_argument("--case", action="append", help="a case of the op's table (repeatable; default: all)")
        s.add_argument("--dtype", action="append")
        s.add_argument("--device", type=int, default=0)
        s.add_argument("--large", action="store_true")
        s.add_argument("--config")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--json", metavar="FILE")
        s.set_defaults(fn=fn)

    s = sub.add_parser(
        "tune", help="autotune an op's tile sizes for a shape; the tuning database",
        description="Tune OP for one problem: enumerate its tuning space, prune (the op's rules, threads per "
        "block, shared memory), compile the rest in parallel, drop spilling kernels (gemm: cuBLASLt's heuristic "
        "candidates instead, found on the GPU), then on the GPU check each "
        "config's outputs against the default config's and time it (warm-up, CUDA events, median of batches, "
        "inputs rotated past L2, random data); the fastest is recorded in the tuning database, which dispatch "
        "uses (KSPEC_TUNE=on|off|auto, KSPEC_TUNING_DB). Without a GPU it prunes and compiles only.",
        epilog="examples:\n"
        "  kspec tune norm_act.fwd --dtype bf16 --shape rows=16384,hidden=4096 --param norm=rmsnorm --param act=silu\n"
        "  kspec tune selective_scan.fwd --dtype bf16 --shape batch=8,dim=2048,seqlen=2048,dstate=16 "
        "--param delta_softplus=true --budget 60 --report out/scan\n"
        "  kspec tune gemm --dtype bf16 --shape m=16384,n=4096,k=4096 --without aux          (y = x·Wᵀ + b)\n"
        "  kspec tune gemm --dtype bf16 --shape m=4097,n=4095,k=33 --param act=gelu --without aux --candidates 16\n"
        "  kspec tune gemm.bwd --dtype bf16 --shape m=16384,n=4096,k=4096 --param act=gelu\n"
        "  kspec tune --list | --export team.json | --import team.json | --db",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("op", nargs="?")
    s.add_argument("--shape", action="append", metavar="DIM=N[,DIM=N]", help="every dim, runtime ones too")
    s.add_argument("--dtype", default="f32")
    s.add_argument("--param", action="append", metavar="K=V")
    s.add_argument("--without", action="append", metavar="INPUT")
    s.add_argument("--alt-shape", action="append", metavar="INPUT")
    s.add_argument("--tensor-dtype", action="append", metavar="NAME=DTYPE")
    s.add_argument("--budget", type=float, default=60.0, help="seconds (default 60); the default config is always timed")
    s.add_argument("--all-configs", action="store_true", help="time every legal config whatever the budget; list pruned ones")
    s.add_argument("--compile-only", action="store_true", help="prune and compile, time nothing")
    s.add_argument("--no-save", action="store_true", help="do not record the winner in the database")
    s.add_argument("--batches", type=int, default=15, help="timed batches per config (the median is kept)")
    s.add_argument("--candidates", type=int, default=16,
                   help="gemm, gemm.bwd: how many of cuBLASLt's heuristic algorithms to time (default 16)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", type=int, default=0)
    s.add_argument("--arch", default="sm_90", help="without a GPU: the architecture to compile for")
    s.add_argument("--report", metavar="PREFIX", help="write PREFIX.png (time per config), PREFIX.csv, PREFIX.json")
    s.add_argument("--json", metavar="FILE", help="the whole result as JSON (with --list: print the entries)")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    s.add_argument("--list", action="store_true", help="the database's entries")
    s.add_argument("--export", dest="export_file", metavar="FILE", help="write the database to FILE")
    s.add_argument("--import", dest="import_file", metavar="FILE", help="merge FILE into the database (the faster record wins)")
    s.add_argument("--db", action="store_true", help="print the database file dispatch reads")
    s.set_defaults(fn=cmd_tune)

    s = sub.add_parser("run", help="the main job: check on a GPU, else precompile everything")
    s.add_argument("--large", action="store_true")
    s.add_argument("--arch", action="append")
    s.add_argument("--json", metavar="FILE")
    s.set_defaults(fn=cmd_run)

    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except (_C.Error, OSError, ValueError) as e:
        # kspec's errors (CacheError is also an OSError), files the command was given or writes, and
        # malformed JSON: one line for the user (a CompileError adds its log), no traceback.
        kind = f"{type(e).__name__}: " if isinstance(e, _C.Error) else ""
        print(f"kspec: error: {kind}{e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
