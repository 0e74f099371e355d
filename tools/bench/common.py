"""What every benchmark family shares besides the timer: the run's context (arguments, torch and kspec
imported on first use, one timer, one copy ceiling), validation against the float64 reference, the
table type, and the errors a family may raise."""
from __future__ import annotations

import math
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field

from .timing import GpuTimer


# Relative error ‖out − ref‖ / ‖ref‖ allowed against the float64 reference, by dtype: kspec's one table
# (kspec::tolerance_for), the tests' too.
# Read on first use, so listing the families needs no kspec.
class _Tolerances(Mapping):
    def _table(self) -> dict:
        from kspec import _C

        return _C.tolerances()

    def __getitem__(self, dtype_name: str) -> float:
        return self._table()[dtype_name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


TOLERANCE = _Tolerances()


def short_error(e: BaseException, limit: int = 2000) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " …"


def record_failure(row: dict, e: BaseException, verbose: bool, torch=None) -> None:
    """A variant that raised (a peer's OOM or compile failure is a result): its row says OOM or error with the
    message, the traceback is printed with --verbose, and torch's cached blocks are released. Call it inside
    the `except` block (the traceback is the exception being handled)."""
    row["status"] = "OOM" if "out of memory" in str(e).lower() else "error"
    row["error"] = short_error(e)
    if verbose:
        traceback.print_exc()
    if torch is not None:
        torch.cuda.empty_cache()


def speedup_vs_kspec(rows: list, keys: tuple = ("shape", "kind")) -> None:
    """Sets each timed row's kspec_speedup_gpu: its gpu_ms over that of the timed kspec row with the same keys
    (> 1: kspec faster)."""
    for r in rows:
        base = next((k for k in rows if k["impl"] == "kspec" and "gpu_ms" in k and all(k[x] == r[x] for x in keys)),
                    None)
        if base and "gpu_ms" in r:
            r["kspec_speedup_gpu"] = r["gpu_ms"] / base["gpu_ms"]


def brief(text: str, limit: int = 160) -> str:
    """The last non-empty line of an error: where a subprocess's stderr ends, the reason usually is."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= limit else last[: limit - 1] + "…"


def rel_error(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (absolute ‖out‖ when ref is all zeros). Arrays or torch tensors on any
    device and of any dtype (numpy takes neither a CUDA tensor nor bfloat16)."""
    import numpy as np

    def f64(a):
        if hasattr(a, "detach") and hasattr(a, "cpu"):  # a torch tensor (torch is imported then)
            import torch

            return a.detach().to("cpu", dtype=torch.float64).numpy()
        return np.asarray(a, dtype=np.float64)

    out, ref = f64(out), f64(ref)
    if out.shape != ref.shape:
        return float("inf")
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(out - ref))
    if math.isnan(num):
        return float("inf")
    return num / den if den > 0 else num


def to_f64(t):
    return t.detach().double().cpu().numpy()


class NoGpu(RuntimeError):
    """No CUDA device (or no torch): the families say so and the run exits with status 2."""


@dataclass
class Section:
    """One table of a family's output; `rows` are dicts, `columns` (header, key or formatter)."""

    title: str
    columns: list
    rows: list
    notes: list = field(default_factory=list)


class Context:
    """What every family shares: arguments, lazily imported torch and kspec, one timer, one copy ceiling.
    The run's options read as ctx.args.<option> or ctx.<option> (so a family's run(args) may treat it
    as the parsed arguments)."""

    def __init__(self, args):
        self.args = args
        self.dev = f"cuda:{args.device}"
        self._timer = None
        self._ceiling = None

    def __getattr__(self, name):
        if name.startswith("_"):  # unset private state and dunder probes are not options
            raise AttributeError(name)
        return getattr(self.args, name)

    @property
    def torch(self):
        try:
            import torch
        except ImportError as e:
            raise NoGpu(f"torch is not importable ({e})") from None
        if not torch.cuda.is_available():
            raise NoGpu("torch sees no CUDA device")
        torch.cuda.set_device(self.args.device)
        return torch

    @property
    def kspec(self):
        import kspec

        return kspec

    @property
    def timer(self) -> GpuTimer:
        if self._timer is None:
            self._timer = GpuTimer(self.torch, self.dev, self.args.reps, self.args.warmup)
        return self._timer

    def skipped(self, variant: str) -> bool:
        return any(s.lower() in variant.lower() for s in self.args.skip or [])

    def copy_ceiling(self) -> dict:
        """Device-to-device copy rate, measured like everything else (bytes = read + write)."""
        if self._ceiling is None:
            torch = self.torch
            dev = self.dev
            n = (256 << 20) if self.args.quick else (1 << 30)
            src = torch.randint(1, 255, (n,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            dst.copy_(src)
            if not torch.equal(dst, src):
                raise RuntimeError("device-to-device copy gave wrong bytes")
            t = self.timer.time(lambda: dst.copy_(src))
            self._ceiling = {"bytes": 2 * n, "copy_tbps": 2 * n / (t["gpu_ms"] * 1e-3) / 1e12,
                             "copy_ev_tbps": 2 * n / (t["ev_ms"] * 1e-3) / 1e12, **t}
            del src, dst
        return self._ceiling
