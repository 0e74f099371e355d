"""Tolerances by dtype (the one table) and the relative error ‖out−ref‖/‖ref‖."""
import numpy as np

TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    den = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / den) if den > 0 else float(num)
