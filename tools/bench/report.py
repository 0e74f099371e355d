"""The one report of a run: the families' tables to stdout (rich when installed), every result with the
environment to a JSON file."""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import time

from .common import Section, short_error


def fmt(v, spec):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return format(v, spec)


# The columns a table of kspec against its peers ends with: kspec's speedup over the row (its time / kspec's,
# gpu and ev), the max relative error against the float64 reference, the status with an error's start.
PEER_COLUMNS = [
    ("kspec × gpu/ev", lambda r: f"{r['kspec_speedup_gpu']:.2f}× / {r['kspec_speedup_ev']:.2f}×"
     if "kspec_speedup_gpu" in r else "—"),
    ("max rel err", lambda r: fmt(r.get("max_error"), ".1e")),
    ("status", lambda r: r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")),
]


def peer_report(title: str, columns: list, rows: list, notes: list, why: str | None = None,
                target_lines: list = ()) -> tuple:
    """A family's (data, sections) for one table of kspec against its peers: its own columns then
    PEER_COLUMNS; its notes, then the absent peer (`why`) and the lines on its targets."""
    notes = list(notes) + ([f"peer absent: {why}"] if why else []) + list(target_lines)
    return {"results": rows}, [Section(title, list(columns) + PEER_COLUMNS, rows, notes)]


def print_section(sec: Section):
    header = [c[0] for c in sec.columns]
    cells = []
    for r in sec.rows:
        line = []
        for _, key in sec.columns:
            v = key(r) if callable(key) else r.get(key)
            line.append("—" if v is None else str(v))
        cells.append(line)
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=sec.title, title_justify="left")
        for h in header:
            t.add_column(h, overflow="fold")
        for line in cells:
            t.add_row(*line)
        console = Console(width=max(200, shutil.get_terminal_size((200, 50)).columns))
        console.print(t)
        for n in sec.notes:
            console.print(n, markup=False, highlight=False)
    except ImportError:
        print(sec.title)
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for line in cells:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
        for n in sec.notes:
            print(n)
    print()


def environment(ctx) -> dict:
    env = {"python": platform.python_version(), "host": platform.node(), "argv": sys.argv,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "peak_tbps": ctx.args.peak_tbps, "quick": ctx.args.quick}
    for mod in ("torch", "triton", "cupy", "liger_kernel", "numpy", "kspec"):
        try:
            m = __import__(mod)
            env[f"{mod}_version"] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            env[f"{mod}_version"] = f"unavailable ({type(e).__name__})"
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(ctx.args.device)
            env["torch_cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    try:
        import kspec

        env["kspec_doctor"] = dict(kspec.doctor())
    except Exception as e:  # noqa: BLE001
        env["kspec_doctor"] = f"unavailable ({short_error(e, 200)})"
    return env


def json_safe(v):
    """Non-finite floats as strings ("inf", "nan"): strict JSON readers reject Infinity and NaN."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def write_json(path: str, report: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe(report), f, indent=1, default=str)
