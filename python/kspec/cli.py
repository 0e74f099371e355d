"""The kspec command line: ops, compile, precompile, cache, doctor, check, run, tune.

Conventions: `--json` prints JSON (only JSON) to stdout; `--output FILE` writes it to a file instead;
progress and errors go to stderr; every expected error is one line with a distinct exit code (EXIT_CODES),
never a traceback."""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import tempfile
import time

from . import _C

# Exit codes, one per kind of failure (listed in `kspec --help`).
EXIT_OK = 0
EXIT_FAILED = 1      # the command ran and found failures (check mismatches, precompile failures, bad entries)
EXIT_USAGE = 2       # a bad command line or argument (argparse, kspec.InvalidArgument, kspec.Unsupported)
EXIT_COMPILE = 3     # NVRTC rejected a specialization (kspec.CompileError)
EXIT_CUDA = 4        # a CUDA error, or no GPU for a command that needs one (kspec.CudaError)
EXIT_IO = 5          # a file or the cache cannot be read or written (kspec.CacheError, OSError)
EXIT_INTERNAL = 70   # a broken invariant of kspec's own (kspec.InternalError): a bug to report
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141      # stdout was closed early (`kspec ops | head`): 128 + SIGPIPE, as a shell reports it
EXIT_CODES = [(EXIT_OK, "success"), (EXIT_FAILED, "the command found failures (check, precompile, cache verify, doctor)"),
              (EXIT_USAGE, "bad command line or argument"), (EXIT_COMPILE, "compile error (NVRTC)"),
              (EXIT_CUDA, "CUDA error, or no GPU where one is needed"), (EXIT_IO, "file or cache error"),
              (EXIT_INTERNAL, "internal error: a bug in kspec, please report it"), (EXIT_INTERRUPTED, "interrupted"),
              (EXIT_PIPE, "output pipe closed early")]


class UsageError(Exception):
    """A command line kspec cannot act on: reported in one line, exit code EXIT_USAGE."""


class NoGpu(Exception):
    """A command that needs a GPU found none: exit code EXIT_CUDA."""


def _emit_json(obj, a, indent=1):
    """--json: the object to stdout; --output FILE: to that file (a summary line stays on stdout)."""
    if getattr(a, "output", None):
        with open(a.output, "w") as f:
            json.dump(obj, f, indent=indent)
    if getattr(a, "json", False):
        print(json.dumps(obj, indent=indent))


def _table(title, columns, rows, file=None):
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in columns:
            t.add_column(c)
        for r in rows:
            t.add_row(*[str(x) for x in r])
        Console(width=200, file=file).print(t)
    except ImportError:
        print(title, file=file)
        print("  ".join(columns), file=file)
        for r in rows:
            print("  ".join(str(x) for x in r), file=file)


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
            raise UsageError(f"{what} expects name=value, got {item!r}")
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


def _local_arch():
    """The first GPU's architecture as kspec compiles for it, or sm_90 without a GPU."""
    for k, v in _C.doctor():
        if k == "gpu 0" and "kernels built for " in v:
            return v.rsplit("kernels built for ", 1)[1].strip()
    return "sm_90"


def cmd_precompile(a):
    defaults = getattr(a, "defaults", None) or []
    if a.all and a.file:
        raise UsageError("precompile: give --all or --file, not both")
    if a.file and defaults:
        raise UsageError("precompile: give --file or --defaults, not both")
    if a.all or defaults:
        # --all: every config of every tuning space for --arch; --defaults ARCH: each case's default plan for ARCH
        archs = (a.arch or [x for x in ("sm_80", "sm_90") if x not in defaults]) if a.all else []
        reqs = _C.precompile_plan(archs, a.op or []) if archs else []
        reqs += _C.defaults_plan(defaults, a.op or []) if defaults else []
        archs = archs + [d for d in defaults if d not in archs]
    elif a.file:
        reqs = _load_requests(a.file)
        archs = sorted({r["arch"] for r in reqs})
    else:
        archs = a.arch or [_local_arch()]
        reqs = _C.quick_plan(archs, a.op or [])
    jobs = a.jobs or _C.compile_threads()
    quick = not a.all and not a.file and not defaults
    results, failures = [], []
    t0 = time.time()
    progress = None
    if not a.json:
        try:
            from rich.console import Console
            from rich.progress import Progress

            progress = Progress(transient=quick, console=Console(stderr=True))
        except ImportError:
            pass

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
                        r["dtype"] = req["dtype"]
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
    cache_dir = _C.cache_stats()["dir"]
    worst = max(results, key=lambda r: r["registers"], default=None)
    summary = (f"kspec precompile: {len(reqs)} requests, {len(results)} kernels ({by_source}) for {archs} in {dt:.1f} s"
               f" with {jobs} threads" + (f"; most registers: {worst['registers']} ({worst['kernel']})" if worst else ""))
    if a.json or a.output:
        _emit_json({"requests": len(reqs), "archs": archs, "seconds": dt, "cache_dir": cache_dir, "results": results,
                    "failures": [[r, e] for r, e in failures]}, a)
    if not a.json:
        if quick:
            order = {n: i for i, n in enumerate(_C.list_ops())}
            rows = sorted(results, key=lambda r: (order.get(r["op"], 0), r["dtype"], r["arch"], r["kernel"]))
            _table(f"kspec precompile: one typical specialization per op and dtype for {', '.join(archs)}",
                   ["op", "dtype", "arch", "kernel", "regs", "spill B", "smem B", "compile ms", "source"],
                   [[r["op"], r["dtype"], r["arch"], r["kernel"].split("<", 1)[0], r["registers"], r["spill_bytes"],
                     r["shared_bytes"], f"{r['compile_ms']:.0f}" if r["source"] == "compiled" else "-", r["source"]]
                    for r in rows])
        print(summary)
        print(f"cache: {cache_dir}" + ("" if not quick else
                                       "   (every specialization of every op: kspec precompile --all)"))
    for req, err in failures[:20]:
        print(f"FAILED {json.dumps(req)}\n  {err}", file=sys.stderr)
    if failures:
        print(f"kspec precompile: {len(failures)} failure(s)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_cache(a):
    if a.action == "stats":
        s = _C.cache_stats()
        if a.json:
            print(json.dumps(s, indent=2))
        else:
            print(f"{s['dir']}: {s['entries']} entries, {s['bytes']} bytes (cap {s['max_bytes']}),"
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
        if a.json:
            print(json.dumps({"ok": ok, "bad": len(bad), "removed": removed, "problems": bad}, indent=1))
        else:
            print(f"{ok} entries ok, {len(bad)} bad ({removed} removed)")
            for b in bad:
                print("  " + b)
        return EXIT_FAILED if bad else EXIT_OK
    elif a.action == "prune":
        n = _C.cache_prune(a.max_bytes if a.max_bytes is not None else -1)
        print(json.dumps({"pruned": n}) if a.json else f"pruned {n} entries")
    elif a.action == "clear":
        n = _C.cache_clear()
        print(json.dumps({"removed": n}) if a.json else f"removed {n} entries")
    return EXIT_OK


def _write_test(directory):
    """Whether a file can really be created in the cache directory: (ok, the error or None). A missing
    directory is created (0700), as the first compile would."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=".kspec-doctor-", dir=directory)
        try:
            os.write(fd, b"kspec doctor\n")
        finally:
            os.close(fd)
            os.unlink(path)
    except OSError as e:
        return False, f"{type(e).__name__}: {e.strerror or e}"
    return True, None


def _doctor_json(facts, write):
    """doctor's facts with their types: numbers as numbers, unset variables as null, the cache as an object."""
    d = dict(facts)
    inc = d.get("cuda include", "")
    gpus = [v for k, v in facts if k.startswith("gpu ")]
    ok, err = write
    return {"kspec": d.get("kspec"), "nvrtc": d.get("nvrtc"),
            "cuda_include": None if inc.startswith("NOT FOUND") else inc, "templates": d.get("templates"),
            "driver": d.get("driver"), "gpu_count": int(d.get("gpus", "0") or 0), "gpus": gpus,
            "cache": dict(_C.cache_stats(), write_test={"ok": ok, "error": err}),
            "cache_permissions": d.get("cache permissions"),
            "environment": {name: os.environ.get(name) for name, *_ in _C.knobs()}}


def cmd_doctor(a):
    facts = list(_C.doctor())
    cache_dir = _C.cache_stats()["dir"]
    write = _write_test(cache_dir)
    if a.json:
        print(json.dumps(_doctor_json(facts, write), indent=2))
    else:
        ok, err = write
        facts.append(("cache write test", f"ok: created and removed a file in {cache_dir}" if ok else
                      f"FAILED: {err} (set KSPEC_CACHE_DIR to a writable directory)"))
        width = max(len(k) for k, _ in facts)
        for k, v in facts:
            print(f"{k:<{width}}  {v}")
    return EXIT_OK if write[0] else EXIT_FAILED


def _gpu_count():
    facts = dict(_C.doctor())
    try:
        return int(facts.get("gpus", "0"))
    except ValueError:
        return 0


def cmd_check(a):
    if _gpu_count() == 0:
        raise NoGpu("check: no GPU visible; nothing to run (kspec precompile --all compiles everything without one)")
    ops = a.op or _C.list_ops()
    rows, ok = [], True
    all_results = []
    t0 = time.time()
    for i, op in enumerate(ops):
        res = [r for case in (a.case or [""])
               for r in _C.check_op(op, case, a.dtype or [], a.device, a.large, a.config, a.seed)]
        if not a.json:  # a first run compiles every case's kernels: say how far it is (the table comes at the end)
            print(f"kspec check: [{i + 1}/{len(ops)}] {op}: {sum(r['passed'] for r in res)}/{len(res)} passed"
                  f" ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        if a.op and not res:
            # An op named on the command line that runs no case would print "0 passed, 0 failed" and exit 0: a
            # check (or a sanitizer run around it) that cannot fail. Ops without a generic reference (e.g.
            # difflogic.packed.net) are checked by their own GPU tests.
            raise UsageError(f"check: {op} ran no case (the generic checker has none for it with these "
                             f"arguments; its own GPU tests check it)")
        for r in res:
            all_results.append(r)
            ok = ok and r["passed"]
            errs = " ".join(f"{n}={e:.1e}" for n, e in r["errors"])
            rows.append([r["op"], r["case"], r["dtype"], r["shape"], r["config"], errs, f"{r['tolerance']:.0e}",
                         "ok" if r["passed"] else "FAIL " + r["message"][:80]])
    passed = sum(1 for r in all_results if r["passed"])
    _emit_json(all_results, a)
    if not a.json:
        _table("kspec check: GPU vs float64 reference (relative error ‖out−ref‖/‖ref‖)",
               ["op", "case", "dtype", "dims", "config", "errors", "tol", "result"], rows)
        print(f"{passed} passed, {len(all_results) - passed} failed")
    return EXIT_OK if ok else EXIT_FAILED


def cmd_run(a):
    """The main job: on a GPU, every op against its reference; without one, the quick precompile."""
    if _gpu_count() > 0:
        return cmd_check(argparse.Namespace(op=None, case=None, dtype=None, device=0, large=a.large, config=None,
                                            seed=0, json=a.json, output=a.output))
    archs = a.arch or ["sm_90"]
    if not a.json:
        print(f"kspec run: no GPU visible — compiling one typical specialization per op and dtype for"
              f" {', '.join(archs)} into the cache instead")
    return cmd_precompile(argparse.Namespace(all=False, file=None, arch=archs, op=None, jobs=None, json=a.json,
                                             output=a.output))


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
        path = tuning.db_path(a.device)
        print(json.dumps({"db": path}) if a.json else path)
        return 0
    if a.export_file:
        n = tuning.export_db(a.export_file)
        print(json.dumps({"exported": n, "file": a.export_file}) if a.json else
              f"kspec tune: exported {n} entries from {tuning.db_path(a.device)} to {a.export_file}")
        return 0
    if a.import_file:
        n = tuning.import_db(a.import_file)
        print(json.dumps({"merged": n, "file": a.import_file}) if a.json else
              f"kspec tune: merged {n} entries from {a.import_file}")
        return 0
    if a.list:
        entries = tuning.db_entries()
        _emit_json(entries, a)
        if a.json:
            return 0
        _table(f"kspec tuning database: {tuning.db_path(a.device)}",
               ["op", "shape", "bucket", "config", "ms", "default ms", "speedup", "updated"],
               [[e.get("op", ""), e.get("shape", ""), e.get("bucket", ""), e.get("config", ""), _fmt_ms(e.get("time_ms")),
                 _fmt_ms(e.get("default_ms")), f"{e.get('speedup', 0):.2f}x", e.get("updated", "")]
                for e in entries.values()])
        return 0
    if not a.op:
        raise UsageError("tune: give an OP (or --list, --export FILE, --import FILE, --db)")
    params = _kv(a.param, "--param")
    shape = _shape(a.shape)
    info = _C.op_info(a.op)
    dims = [d["name"] for d in info["dims"]]
    for name in shape:
        if name not in dims:
            raise UsageError(f"tune: {a.op} has no dim {name!r} (its dims: {', '.join(dims)}; scalar params such"
                             f" as {', '.join(p['name'] for p in info['params']) or 'none'} go in --param)")
    if a.candidates < 1:
        raise UsageError(f"tune: --candidates must be at least 1, got {a.candidates}")
    cb, stop = _tune_progress() if not (a.quiet or a.json) else (None, lambda: None)
    try:
        r = tuning.tune(a.op, a.dtype, shape, budget=a.budget, all_configs=a.all_configs, device=a.device,
                        arch=a.arch, without=a.without or [], alt_shapes=a.alt_shape or [],
                        tensor_dtypes={k: str(v) for k, v in _kv(a.tensor_dtype, "--tensor-dtype").items()},
                        compile_only=a.compile_only, write_db=not a.no_save, batches=a.batches, seed=a.seed,
                        progress=cb, candidates=a.candidates, **params)
    finally:
        stop()
    _emit_json(r, a)
    if not a.json:
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
    _report(r, a)
    return 0


def _report(r, a):
    from . import tuning

    if not a.report:
        return
    paths = tuning.write_report(r, a.report)
    for path in paths:
        print(f"wrote {path}", file=sys.stderr if a.json else sys.stdout)
    if not any(p.endswith(".png") for p in paths):
        why = tuning.PLOT_HINT if not tuning.plotting_available() else "no PNG: no configuration was timed"
        print(f"kspec tune: {why}", file=sys.stderr)


def _json_flags(s, output=True):
    s.add_argument("--json", action="store_true", help="print the result as JSON (only JSON) to stdout")
    if output:
        s.add_argument("--output", "-o", metavar="FILE", help="also write the result as JSON to FILE")


def build_parser() -> argparse.ArgumentParser:
    epilog = "exit codes:\n" + "\n".join(f"  {code:<4} {what}" for code, what in EXIT_CODES)
    p = argparse.ArgumentParser(prog="kspec", description="JIT kernel specialization for sequence models",
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kspec {_C.version()}", help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("ops", help="the registry with schemas")
    s.add_argument("name", nargs="?", help="one op (default: every op)")
    _json_flags(s, output=False)
    s.set_defaults(fn=cmd_ops)

    s = sub.add_parser("compile", help="specialize + compile one op (no GPU needed)")
    s.add_argument("op", help="the op, e.g. norm_act.fwd (kspec ops lists them)")
    s.add_argument("--dtype", default="f32", help="the op's main dtype: f32, f16 or bf16 (default f32)")
    s.add_argument("--arch", default="sm_90", help="the GPU architecture to compile for (default sm_90)")
    s.add_argument("--param", action="append", metavar="K=V", help="params and compile-time dims, e.g. hidden=4096")
    s.add_argument("--without", action="append", metavar="INPUT", help="leave out an optional input")
    s.add_argument("--alt-shape", action="append", metavar="INPUT",
                   help="give an input in its alternative shape (e.g. a fixed B [dim, dstate])")
    s.add_argument("--tensor-dtype", action="append", metavar="NAME=DTYPE",
                   help="one tensor's dtype where it differs from --dtype (e.g. weight=f32)")
    s.add_argument("--config", help="tuning config, e.g. threads_per_row=256,rows_per_block=1,vec=8,stream=0")
    _json_flags(s, output=False)
    s.add_argument("--verbose", "-v", action="store_true", help="show NVRTC's log (ptxas figures); indent the JSON")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser("precompile", help="compile into the cache: one typical specialization per op and dtype "
                       "(about a minute), --all every op x dtype x config, or --file a list")
    s.add_argument("--all", action="store_true",
                   help="every op x case x dtype x tuning config (default archs sm_80 and sm_90); fails on a spill")
    s.add_argument("--file", help="JSON lines (or a JSON list) of compile requests {op, dtype, arch, params, ...}")
    s.add_argument("--arch", action="append",
                   help="architecture to compile for (repeatable; default: the GPU's, else sm_90; with --all sm_80 and sm_90)")
    s.add_argument("--defaults", action="append", metavar="ARCH",
                   help="also every op x case x dtype with the config dispatch chooses, for ARCH (repeatable; "
                        "alone or beside --all's full sweep of --arch); fails on a spill")
    s.add_argument("--op", action="append", help="only this op (repeatable)")
    s.add_argument("--jobs", type=int, help="compile threads (default KSPEC_COMPILE_THREADS, else the cores)")
    _json_flags(s)
    s.set_defaults(fn=cmd_precompile)

    s = sub.add_parser("cache", help="the disk cache")
    s.add_argument("action", choices=["stats", "list", "verify", "prune", "clear"],
                   help="stats, list the entries, verify (and remove bad ones), prune to a size, clear")
    s.add_argument("--max-bytes", type=int, help="prune: the size to prune to (default KSPEC_CACHE_MAX_BYTES)")
    _json_flags(s, output=False)
    s.set_defaults(fn=cmd_cache)

    s = sub.add_parser("doctor", help="driver, toolkit, NVRTC, GPUs, cache directory (and a write test)")
    _json_flags(s, output=False)
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("check", help="every op on the GPU against its float64 reference")
    s.add_argument("--op", action="append", help="only this op (repeatable; default: every op)")
    s.add_argument("--case", action="append", help="a case of the op's table (repeatable; default: all)")
    s.add_argument("--dtype", action="append", help="only this dtype (repeatable; default: the op's dtypes)")
    s.add_argument("--device", type=int, default=0, help="the GPU to run on (default 0)")
    s.add_argument("--large", action="store_true", help="also the large cases")
    s.add_argument("--config", help="a tuning config to run instead of dispatch's choice")
    s.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    _json_flags(s)
    s.set_defaults(fn=cmd_check)

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
    s.add_argument("op", nargs="?", help="the op to tune (kspec ops lists them)")
    s.add_argument("--shape", action="append", metavar="DIM=N[,DIM=N]", help="every dim, runtime ones too")
    s.add_argument("--dtype", default="f32", help="the op's main dtype: f32, f16 or bf16 (default f32)")
    s.add_argument("--param", action="append", metavar="K=V", help="a scalar param, e.g. act=silu (repeatable)")
    s.add_argument("--without", action="append", metavar="INPUT", help="leave out an optional input")
    s.add_argument("--alt-shape", action="append", metavar="INPUT", help="give an input in its alternative shape")
    s.add_argument("--tensor-dtype", action="append", metavar="NAME=DTYPE",
                   help="one tensor's dtype where it differs from --dtype")
    s.add_argument("--budget", type=float, default=60.0, help="seconds (default 60); the default config is always timed")
    s.add_argument("--all-configs", action="store_true", help="time every legal config whatever the budget; list pruned ones")
    s.add_argument("--compile-only", action="store_true", help="prune and compile, time nothing")
    s.add_argument("--no-save", action="store_true", help="do not record the winner in the database")
    s.add_argument("--batches", type=int, default=15, help="timed batches per config (the median is kept)")
    s.add_argument("--candidates", type=int, default=16,
                   help="gemm, gemm.bwd: how many of cuBLASLt's heuristic algorithms to time (default 16)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    s.add_argument("--device", type=int, default=0, help="the GPU to tune on (default 0)")
    s.add_argument("--arch", default="sm_90", help="without a GPU: the architecture to compile for")
    s.add_argument("--report", metavar="PREFIX",
                   help="write PREFIX.json, PREFIX.csv and, with matplotlib (pip install 'kspec[plot]'), PREFIX.png")
    _json_flags(s)
    s.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    s.add_argument("--list", action="store_true", help="the database's entries")
    s.add_argument("--export", dest="export_file", metavar="FILE", help="write the database to FILE")
    s.add_argument("--import", dest="import_file", metavar="FILE", help="merge FILE into the database (the faster record wins)")
    s.add_argument("--db", action="store_true", help="print the database file dispatch reads")
    s.set_defaults(fn=cmd_tune)

    s = sub.add_parser("run", help="the main job: check on a GPU, else the quick precompile (about a minute)")
    s.add_argument("--large", action="store_true", help="on a GPU: also the large cases")
    s.add_argument("--arch", action="append", help="without a GPU: the architecture to compile for (default sm_90)")
    _json_flags(s)
    s.set_defaults(fn=cmd_run)
    return p


def _exit_code(e: BaseException) -> int:
    if isinstance(e, _C.InternalError):
        return EXIT_INTERNAL
    if isinstance(e, _C.CompileError):
        return EXIT_COMPILE
    if isinstance(e, (_C.CudaError, NoGpu)):
        return EXIT_CUDA
    if isinstance(e, (_C.InvalidArgument, _C.Unsupported, UsageError)):
        return EXIT_USAGE
    if isinstance(e, (_C.CacheError, OSError)):
        return EXIT_IO
    return EXIT_USAGE  # ValueError: a malformed file or value the command was given


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)  # a bad command line: argparse's message, exit code 2
    try:
        return a.fn(a)
    except BrokenPipeError:
        # The reader went away (`kspec cache list | head`): no traceback, and no second error when Python
        # flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE
    except KeyboardInterrupt:
        print("kspec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (_C.Error, UsageError, NoGpu, OSError, ValueError) as e:
        # kspec's errors (CacheError is also an OSError), files the command was given or writes, and
        # malformed JSON: one line for the user (a CompileError adds its log), no traceback.
        kind = f"{type(e).__name__}: " if isinstance(e, _C.Error) else ""
        print(f"kspec: error: {kind}{e}", file=sys.stderr)
        if isinstance(e, _C.InternalError):
            print("kspec: this is a bug in kspec; please report it with the command that caused it", file=sys.stderr)
        return _exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
