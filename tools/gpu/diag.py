"""Diagnostic: which kspec calls survive in a process that imported torch first (GPU machine)."""
import sys

import numpy as np
import torch

import kspec
from kspec import _C

x = torch.randn(4, 64, device="cuda")
w = torch.randn(64, device="cuda")
for name, fn in [
    ("describe_op", lambda: _C.describe_op("norm_act.fwd")),
    ("doctor", lambda: _C.doctor()),
    ("infer_ok", lambda: _C.infer_outputs("norm_act.fwd", [kspec._tensors.describe(x), kspec._tensors.describe(w), None], {})),
    ("call_ok", lambda: kspec.call("norm_act.fwd", x, w, None)[0].sum().item()),
    ("unknown_op", lambda: kspec.compile("nope.x", hidden=8)),
    ("infer_cpu_error", lambda: kspec.call("norm_act.fwd", np.zeros((2, 8), np.float32), np.ones(8, np.float32), None)),
    ("check", lambda: kspec.check("norm_act.fwd", case="base")[0]["passed"]),
]:
    try:
        r = fn()
        print(name, "ok", str(r)[:60], flush=True)
    except Exception as e:
        print(name, type(e).__name__, str(e)[:80], flush=True)
