"""tools/bench/bench.py without a GPU: it compiles, its napkin math holds (the GPT-350M parameter list, the
GEMM FLOP and byte counts), and asking for a GPU family ends with a clear 'no GPU' message and status 2,
not a traceback; tools/bench/bench_e79.py compiles and says 'no CUDA GPU' (status 1). The timings
themselves run on the GPU machine (tools/gpu/check.sh bench, e79)."""
import importlib.util
import json
import math
import os
import pathlib
import py_compile
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "tools/bench/bench.py"
BENCH_E79 = BENCH.with_name("bench_e79.py")


def _bench():
    spec = importlib.util.spec_from_file_location("kspec_bench_script", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_compiles():
    py_compile.compile(str(BENCH), doraise=True)


def test_families_are_registered():
    assert {"norm_act", "selective_scan", "gemm", "adamw", "jit"} <= set(_bench().FAMILIES)


def test_linear_sweep_covers_the_issue_shapes():
    """Small K (7, 33, 64), small M (1, 32), odd N (4095, 4097) and an LLM shape, within one table."""
    b = _bench()
    assert "linear_sweep" in b.FAMILIES
    shapes = b.linear_sweep_shapes(quick=False)
    assert {7, 33, 64} <= {k for _, _, k in shapes} and {1, 32} <= {m for m, _, _ in shapes}
    assert {4095, 4097} <= {n for _, n, _ in shapes} and (16384, 4096, 4096) in shapes


def test_gpt350m_parameter_list():
    shapes = _bench().gpt350m_shapes()
    assert len(shapes) == 243
    assert sum(math.prod(s) for s in shapes) == 354_821_120  # peers.md: 353.6 M in 243 tensors (shapes unrecorded)
    assert shapes[0] == (50304, 1024) and shapes[1] == (1024, 1024)


def test_gemm_napkin_math():
    b = _bench()
    assert b.gemm_flops(16384, 4096, 4096, "fwd") == 2 * 16384 * 4096 * 4096
    assert b.gemm_flops(16384, 4096, 4096, "bwd") == 4 * 16384 * 4096 * 4096
    # decode: x (8x4096), W (11008x4096), b, y (8x11008), bf16
    assert b.gemm_min_bytes(8, 11008, 4096, "fwd", "gelu", True, 2) == 2 * (8 * 4096 + 11008 * 4096 + 8 * 11008 + 11008)


def test_gpu_families_without_a_gpu_say_so(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(BENCH), "--family", "gemm,adamw", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 2, text
    assert "no GPU" in p.stderr and "Traceback" not in text, text
    errors = json.loads(out.read_text())["errors"]
    assert set(errors) == {"gemm", "adamw"} and all(e.startswith("no GPU") for e in errors.values())


def test_bench_e79_without_a_gpu_says_so():
    py_compile.compile(str(BENCH_E79), doraise=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(BENCH_E79), "--quick"], capture_output=True, text=True, env=env,
                       timeout=600)
    if "No module named 'torch'" in p.stderr:
        pytest.skip("no torch")
    assert p.returncode == 1 and "no CUDA GPU" in p.stderr and "Traceback" not in p.stdout + p.stderr, p.stderr
