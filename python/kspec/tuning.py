"""The autotuner from Python: kspec.tune() runs the C++ tuner (prune, parallel compile, verify against
the default config, time on the GPU, record the winner in the tuning database); this module adds the
progress display, the table and the reports (JSON, CSV, PNG), and the database's export/import."""
from __future__ import annotations

import csv
import json
import os

from . import _C


def tune(op: str, dtype: str = "f32", shape=None, *, budget: float = 60.0, all_configs: bool = False,
         device: int = 0, arch: str = "sm_90", without=(), tensor_dtypes=None, alt_shapes=(),
         compile_only: bool = False, write_db: bool = True, batches: int = 15, seed: int = 0,
         progress=None, candidates: int = 16, **params) -> dict:
    """Tune `op` for one problem and record the winner in the tuning database.

    shape: the dims, runtime ones too, e.g. {"rows": 16384, "hidden": 4096} (or as keyword params).
    progress: None, or a callable (phase, done, total, candidate_dict_or_None).
    candidates: for gemm / gemm.bwd, how many of cuBLASLt's heuristic algorithms to time (its first
    choice is the default; the winner is recorded as its config fields, e.g. "algo=..,tile=..,stages=..").
    Returns a dict: key, bucket, db_path, default_config/default_ms, best_config/best_ms, timed,
    written, and `candidates` (one dict per configuration: config, status, why, median_ms, error...).
    Without a GPU (or with compile_only) it prunes and compiles only (timed is False)."""
    all_params = dict(shape or {})
    all_params.update(params)
    return _C.tune(op, dtype, all_params, list(without), dict(tensor_dtypes or {}), list(alt_shapes), device, arch,
                   float(budget), all_configs, compile_only, write_db, batches, seed, progress, int(candidates))


def db_path(device: int = 0) -> str:
    """The tuning database file dispatch reads for a device (KSPEC_TUNING_DB overrides)."""
    return _C.tuning_db_path(device)


def db_entries(path: str = "") -> dict:
    """The database's entries: key → record (config, time_ms, default_ms, shape, gpu, ...)."""
    return json.loads(_C.tuning_db_entries(path))


def export_db(file: str, path: str = "") -> int:
    """Write the database (this GPU's, or `path`) to `file`; returns the number of entries."""
    return _C.tuning_export(file, path)


def import_db(file: str) -> int:
    """Merge an exported database into the one for its GPU and toolkit (the faster record wins)."""
    return _C.tuning_import(file)  # a missing, non-regular or oversized file: InvalidArgument


# ---- reports ----

_COLUMNS = ["config", "default", "status", "median_ms", "min_ms", "speedup", "error", "registers", "spill_bytes",
            "shared_bytes", "compile_ms", "why", "tflops"]


def flops(result: dict) -> float:
    """Floating-point operations of one call of a gemm problem (2·batch·m·n·k; gemm.bwd's dx and dW: twice
    that), else 0 (ops timed by bytes, not flops)."""
    if result.get("op") not in ("gemm", "gemm.bwd"):
        return 0.0
    dims = dict(kv.split("=") for kv in result.get("shape", "").split(",") if "=" in kv)
    try:
        n = 2.0 * max(int(dims.get("batch", 1)), 1) * int(dims["m"]) * int(dims["n"]) * int(dims["k"])
    except (KeyError, ValueError):
        return 0.0
    return 2 * n if result["op"] == "gemm.bwd" else n


def config_label(result: dict, config: str) -> str:
    """A config for display: gemm's empty config is cuBLASLt's own first choice."""
    if config:
        return config
    return "(cuBLASLt heuristic)" if result.get("op") in ("gemm", "gemm.bwd") else "(none)"


def table_rows(result: dict, include_pruned: bool = False):
    """Candidates for display: timed ones fastest first, then the rest (pruned ones only if asked)."""
    base = result.get("default_ms") or -1
    fl = flops(result)
    rows = []
    for c in result["candidates"]:
        if not include_pruned and c["status"] == "pruned":
            continue
        r = dict(c)
        r["speedup"] = base / c["median_ms"] if c["median_ms"] > 0 and base > 0 else -1
        r["tflops"] = fl / (c["median_ms"] * 1e9) if fl and c["median_ms"] > 0 else -1
        rows.append(r)
    rows.sort(key=lambda r: (r["status"] != "ok", r["median_ms"] if r["median_ms"] > 0 else 1e30))
    return rows


# Shown where a plot was asked for and matplotlib (the `plot` extra) is not installed.
PLOT_HINT = "no PNG: matplotlib is not installed (pip install 'kspec[plot]')"


def plotting_available() -> bool:
    """Whether write_report can draw PREFIX.png (matplotlib, the `plot` extra, is importable)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_report(result: dict, prefix: str) -> list:
    """Writes PREFIX.json (the whole result), PREFIX.csv (one row per configuration) and, where matplotlib
    is installed and some configuration was timed, PREFIX.png (time per configuration, the winner and the
    default marked). Returns the paths written (the PNG missing from them says it was not drawn: see
    plotting_available())."""
    d = os.path.dirname(prefix)
    if d:
        os.makedirs(d, exist_ok=True)
    paths = [prefix + ".json", prefix + ".csv"]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths[1], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_COLUMNS)
        for r in table_rows(result, include_pruned=True):
            w.writerow([r.get(c, "") for c in _COLUMNS])
    timed = [r for r in table_rows(result) if r["status"] == "ok"]
    if timed and plotting_available():
        _plot(result, timed, prefix + ".png")
        paths.append(prefix + ".png")
    return paths


def _plot(result, timed, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.28 * len(timed) + 1)))
    labels = [config_label(result, r["config"]) + ("  (default)" if r["default"] else "") for r in timed]
    colors = ["tab:green" if r["config"] == result["best_config"] else "tab:orange" if r["default"] else "tab:blue"
              for r in timed]
    ax.barh(range(len(timed)), [r["median_ms"] for r in timed], color=colors)
    ax.set_yticks(range(len(timed)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("median ms per call")
    ax.set_title(f"{result['op']} {result['shape']} on {result['gpu']}: winner green, default orange", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

