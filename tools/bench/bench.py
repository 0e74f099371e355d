#!/usr/bin/env python3
"""kspec benchmarks: one runner, a file per op family, the peers in the same process.

    python3 tools/bench/bench.py                       # every family of `all` (--list shows them)
    python3 tools/bench/bench.py --family gemm --family adamw --json /tmp/bench.json
    python3 tools/bench/bench.py --family norm_act --quick --json /tmp/bench.json
    python3 tools/bench/bench.py --family jit --dispatch-bin build/tools/bench/kspec_dispatch_bench

A family is a file beside this one that sets FAMILY (see README.md, "Adding a family"); the runner finds
it, adds its options and runs it with the shared timer (timing.py) and report (report.py).
Method (the one of /work/shared/peers.md, so figures compare): random inputs, never zeros; every
variant checked against the float64 reference before it is timed; CUDA events around one call, a
256 MiB write between calls to flush L2, the median over >= 30 calls after warm-up; two times per
call: gpu (a GPU spin queued before the start event, so the whole call is queued before the clock
starts) and ev (plain events after a synchronize, so host launch time shows when the host is slower
than the GPU).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import pathlib
import sys
import time
import traceback
import types

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = "kspec_bench"  # tools/bench imported as one package: the families' relative imports, no clash
# between a family's file name and a peer's package (a difflogic.py family importing `difflogic`)
# Run as a script, Python puts this folder first on sys.path, where difflogic.py and jax.py would still
# shadow those packages (the H100 run of 2026-11-27 saw "difflogic not importable"): take it off.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != HERE]


def _package(folder: pathlib.Path, name: str):
    pkg = sys.modules.get(name)
    if pkg is None:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(folder)]
        sys.modules[name] = pkg
    elif list(pkg.__path__) != [str(folder)]:
        raise SystemExit(f"bench: package {name} is already {list(pkg.__path__)}, not {folder}")
    return pkg


def family_files(folder: pathlib.Path = HERE) -> dict:
    """{family name: file} for every *.py in folder that assigns a string to FAMILY at module level,
    found by parsing (nothing is imported: a helper script beside the families is never run)."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(), str(path))
        except SyntaxError as e:
            raise SystemExit(f"bench: {path.name} does not parse: {e}") from None
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FAMILY" for t in node.targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                name = node.value.value
                if name in found:
                    raise SystemExit(f"bench: family {name!r} is declared by both {found[name].name} and {path.name}")
                found[name] = path
    return found


def discover(folder: pathlib.Path = HERE, package: str = PACKAGE) -> dict:
    """{family name: its module}, imported as <package>.<file stem>; each must define run(ctx)."""
    _package(folder, package)
    families = {}
    for name, path in family_files(folder).items():
        module = importlib.import_module(f"{package}.{path.stem}")
        if not callable(getattr(module, "run", None)):
            raise SystemExit(f"bench: {path.name} sets FAMILY = {name!r} but defines no run(ctx)")
        families[name] = module
    return families


def in_all(module) -> bool:
    return getattr(module, "IN_ALL", True)


def parser(families: dict) -> argparse.ArgumentParser:
    listing = "\n".join(f"  {n:<24} {getattr(m, 'DESCRIPTION', '')}{'' if in_all(m) else ' [on request]'}"
                        for n, m in families.items())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="families:\n" + listing,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", action="append", metavar="NAME",
                   help="a family, or 'all' (default: every family not marked [on request]);"
                        " repeatable or comma-separated")
    p.add_argument("--list", action="store_true",
                   help="print the families of 'all', one a line: name, the peer build it waits for (or -),"
                        " description")
    p.add_argument("--quick", action="store_true", help="small shapes, fewer calls: a smoke test, not figures")
    p.add_argument("--json", metavar="OUT", help="write every result (and the environment) to this file")
    p.add_argument("--reps", type=int, help="timed calls per variant, median taken (default 50; --quick 30)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--check-rows", type=int, default=256, help="rows compared with the float64 reference")
    p.add_argument("--peak-tbps", type=float, default=3.0, help="the bandwidth %% is of this (H100 copy: 3.0)")
    p.add_argument("--skip", action="append", metavar="TEXT", help="skip variants whose name contains TEXT")
    p.add_argument("--time-invalid", action="store_true",
                   help="time kspec variants that fail validation too (failing peers are always timed, flagged)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", "-v", action="store_true", help="print tracebacks of failing variants")
    for name, module in families.items():
        if hasattr(module, "add_arguments"):
            module.add_arguments(p.add_argument_group(f"{name} options"))
    return p


def parse_args(families: dict, argv=None):
    """The parsed options and the family names to run, in order."""
    p = parser(families)
    args = p.parse_args(argv)
    args.reps_given = args.reps is not None  # a family whose calls take seconds keeps its own default
    if args.reps is None:
        args.reps = 30 if args.quick else 50
    if args.reps < 30:
        print(f"bench: --reps {args.reps} is below the method's 30; the medians are less stable", file=sys.stderr)
    names = []
    for f in args.family or ["all"]:
        names += [n.strip() for n in f.split(",") if n.strip()]
    unknown = [n for n in names if n != "all" and n not in families]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)}; known: {', '.join(families)}")
    expanded = []
    for n in names:
        for m in ([k for k, v in families.items() if in_all(v)] if n == "all" else [n]):
            if m not in expanded:
                expanded.append(m)
    return args, expanded


def run_family(module, ctx):
    """(json-able dict, [Section]) from a family's run(ctx), which may also return only the dict, or None
    when it printed its own output."""
    out = module.run(ctx)
    if out is None:
        return {}, []
    if isinstance(out, tuple):
        data, sections = out
        return dict(data), list(sections)
    return dict(out), []


def main(argv=None, families: dict | None = None) -> int:
    families = discover() if families is None else families
    args, names = parse_args(families, argv)
    if args.list:
        for n, m in families.items():
            if in_all(m):
                print(f"{n} {getattr(m, 'NEEDS_BUILD', None) or '-'} {getattr(m, 'DESCRIPTION', '')}")
        return 0

    _package(HERE, PACKAGE)  # the shared modules, also when the families came from elsewhere (tests)
    from kspec_bench.common import Context, NoGpu, short_error
    from kspec_bench.report import environment, print_section, write_json

    ctx = Context(args)
    report = {"environment": environment(ctx), "families": {}, "errors": {}}
    failed = False
    no_gpu = 0
    try:
        for name in names:
            t0 = time.perf_counter()
            try:
                data, sections = run_family(families[name], ctx)
                data["seconds"] = time.perf_counter() - t0
                report["families"][name] = data
                for s in sections:
                    print_section(s)
            except NoGpu as e:
                no_gpu += 1
                report["errors"][name] = f"no GPU: {e}"
                print(f"bench: family {name}: no GPU ({e}); nothing measured", file=sys.stderr)
            except Exception as e:
                failed = True
                report["errors"][name] = short_error(e, 8000)
                print(f"bench: family {name} failed: {short_error(e, 1000)}", file=sys.stderr)
                if args.verbose:
                    traceback.print_exc()
        try:
            import kspec

            report["environment"]["kspec_counters"] = dict(kspec.counters())
        except Exception:  # noqa: BLE001
            pass
    finally:
        if args.json:
            write_json(args.json, report)
            print(f"bench: wrote {args.json}")
    if no_gpu and no_gpu == len(names):
        return 2
    return 1 if failed or no_gpu else 0


if __name__ == "__main__":
    sys.exit(main())
