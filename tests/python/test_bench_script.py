"""tools/bench without a GPU: the runner finds every family file (and only those), parses every family's
options without collisions, runs a family's run() and writes the report; the napkin math holds (the
GPT-350M parameter list, the GEMM FLOP and byte counts); asking for a GPU family ends with a clear 'no GPU'
message and status 2, not a traceback. The timings themselves run on the GPU machine (tools/gpu/check.sh
bench, e79)."""
import importlib.util
import json
import math
import os
import pathlib
import py_compile
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parents[2] / "tools/bench"
BENCH = HERE / "bench.py"
EXPECTED = {"norm_act", "selective_scan", "selective_scan_configs", "gemm", "linear_sweep", "adamw", "jit", "e79", "dispatch",
            "mlstm", "mhc", "difflogic", "mamba_block"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kspec_bench_script", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def families(bench):
    return bench.discover()


@pytest.mark.parametrize("path", sorted(HERE.glob("*.py")), ids=lambda p: p.name)
def test_compiles(path):
    py_compile.compile(str(path), doraise=True)


def test_every_family_file_is_discovered(bench, families):
    assert EXPECTED <= set(families)
    assert all(callable(m.run) and m.DESCRIPTION for m in families.values())
    # helper modules are not families; adamw_host.py (a script) is never imported by discovery
    assert not {"common", "timing", "report", "bench", "adamw_host"} & set(families)
    assert "kspec_bench.adamw_host" not in sys.modules


def _write_family(folder, stem, body):
    (folder / f"{stem}.py").write_text(body)


def test_a_new_family_is_one_file(bench, tmp_path):
    """A file that sets FAMILY and defines run() is found; run(args) returning a dict lands in the JSON
    (the convention tools/bench/dispatch.py follows); IN_ALL = False keeps a sweep out of 'all'; a file
    without FAMILY is never imported (it would raise)."""
    _write_family(tmp_path, "toy", 'FAMILY = "toy"\nDESCRIPTION = "a toy"\n\n\ndef add_arguments(p):\n'
                  '    p.add_argument("--toy-size", type=int, default=3)\n\n\n'
                  'def run(args):\n    return {"size": args.toy_size, "quick": args.quick}\n')
    _write_family(tmp_path, "toy_sweep", 'FAMILY = "toy_sweep"\nIN_ALL = False\n\n\ndef run(ctx):\n    return None\n')
    _write_family(tmp_path, "helper", 'raise RuntimeError("a helper must not be imported")\n')
    found = bench.discover(tmp_path, package="kspec_bench_test_toy")
    assert set(found) == {"toy", "toy_sweep"}
    args, names = bench.parse_args(found, ["--toy-size", "7"])
    assert names == ["toy"] and args.toy_size == 7 and args.reps == 50
    _, names = bench.parse_args(found, ["--family", "toy_sweep,toy", "--family", "all"])
    assert names == ["toy_sweep", "toy"]
    out = tmp_path / "out" / "report.json"
    assert bench.main(["--toy-size", "5", "--quick", "--json", str(out)], families=found) == 0
    report = json.loads(out.read_text())
    assert report["families"]["toy"]["size"] == 5 and report["families"]["toy"]["quick"] is True
    assert report["errors"] == {}


def test_discovery_errors_name_the_file(bench, tmp_path):
    _write_family(tmp_path, "a", 'FAMILY = "same"\n\n\ndef run(ctx):\n    pass\n')
    _write_family(tmp_path, "b", 'FAMILY = "same"\n\n\ndef run(ctx):\n    pass\n')
    with pytest.raises(SystemExit, match="both a.py and b.py"):
        bench.discover(tmp_path, package="kspec_bench_test_dup")
    (tmp_path / "b.py").write_text('FAMILY = "norun"\n')
    with pytest.raises(SystemExit, match="b.py sets FAMILY = 'norun' but defines no run"):
        bench.discover(tmp_path, package="kspec_bench_test_norun")


def test_cli_parsing(bench, families, capsys):
    """Every family's options in one parser (argparse raises on a collision); e79's options before the
    runner took it over (check.sh's KSPEC_BENCH_E79_ARGS) still parse; unknown families are refused."""
    e79 = families["e79"]
    args, names = bench.parse_args(families, ["--family", "e79", "--B", "1", "16", "--no-compile", "--n", "64"])
    o = e79.options(args)
    assert names == ["e79"] and o.B == [1, 16] and o.n == [64] and o.T == [512, 4096] and o.no_compile
    assert o.reps == 10 and o.ref_reps == 3 and o.clusters == [2, 4, 8]
    args, _ = bench.parse_args(families, ["--family", "e79", "--e79-T", "128", "--reps", "40", "--quick"])
    o = e79.options(args)
    assert o.reps == 40 and (o.B, o.T, o.n) == ([16], [4096], [64])  # --quick: the target point
    args, names = bench.parse_args(families, [])
    assert set(names) == EXPECTED - {"linear_sweep", "selective_scan_configs"}  # the sweeps run on request
    assert args.scan_op == "fwd" and args.peak_tflops == pytest.approx(989.4) and args.jit_hidden == 4224
    with pytest.raises(SystemExit):
        bench.parse_args(families, ["--family", "nonesuch"])
    assert "unknown family nonesuch" in capsys.readouterr().err


def test_list_is_what_check_sh_reads():
    p = subprocess.run([sys.executable, str(BENCH), "--list"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line.split()[1] for line in p.stdout.splitlines()}
    assert set(rows) == EXPECTED - {"linear_sweep", "selective_scan_configs"}
    assert rows["selective_scan"] == "mamba" and rows["gemm"] == "-" and rows["difflogic"] == "difflogic"


def test_linear_sweep_covers_the_issue_shapes(families):
    """Small K (7, 33, 64), small M (1, 32), odd N (4095, 4097) and an LLM shape, within one table."""
    shapes = families["linear_sweep"].linear_sweep_shapes(quick=False)
    assert {7, 33, 64} <= {k for _, _, k in shapes} and {1, 32} <= {m for m, _, _ in shapes}
    assert {4095, 4097} <= {n for _, n, _ in shapes} and (16384, 4096, 4096) in shapes


def test_gpt350m_parameter_list(families):
    shapes = families["adamw"].gpt350m_shapes()
    assert len(shapes) == 243
    assert sum(math.prod(s) for s in shapes) == 354_821_120  # peers.md: 353.6 M in 243 tensors (shapes unrecorded)
    assert shapes[0] == (50304, 1024) and shapes[1] == (1024, 1024)


def test_gemm_napkin_math(families):
    g = families["gemm"]
    assert g.gemm_flops(16384, 4096, 4096, "fwd") == 2 * 16384 * 4096 * 4096
    assert g.gemm_flops(16384, 4096, 4096, "bwd") == 4 * 16384 * 4096 * 4096
    # decode: x (8x4096), W (11008x4096), b, y (8x11008), bf16
    assert g.gemm_min_bytes(8, 11008, 4096, "fwd", "gelu", True, 2) == 2 * (8 * 4096 + 11008 * 4096 + 8 * 11008 + 11008)


def test_mlstm_mhc_difflogic_napkin_math(families):
    """Issue 29's FLOP formula; issue 34's bytes (pre fwd 0.67 GB, post fwd 1.21, post bwd 1.88, pre bwd with
    the post's dx 1.75 at T = 16384, n = 4, D = 4096 bf16); issue 30's anchor (difflogic 64k: 16% / 10%)."""
    assert families["mlstm"].flops(8, 8, 4096, 128, 128, "fwd") == 64 * 4096 * (4 * 128 * 128 + 128 * 256)
    assert families["mlstm"].flops(1, 1, 1, 64, 64, "fwd+bwd") == 3 * (4 * 64 * 64 + 128 * 128)
    mb = families["mhc"].min_bytes
    T, n, D = 16384, 4, 4096
    assert round(mb("pre", "fwd", T, n, D) / 1e9, 2) == 0.67 and round(mb("post", "fwd", T, n, D) / 1e9, 2) == 1.21
    assert round((mb("post", "fwd+bwd", T, n, D) - mb("post", "fwd", T, n, D)) / 1e9, 2) == 1.88
    layer_bwd = mb("layer", "fwd+bwd", T, n, D) - mb("layer", "fwd", T, n, D)
    assert abs((layer_bwd - 3 * T * n * D * 2 - 2 * T * D * 2) / 1e9 - 1.75) < 0.01
    # post(l) + pre(l + 1) fused: one read of x (537 MB) less than post then pre
    saved = mb("post", "fwd", T, n, D) + mb("pre", "fwd", T, n, D) - mb("post_pre", "fwd", T, n, D)
    assert saved == T * n * D * 2 and round(saved / 1e6) == 537
    db = families["difflogic"].min_bytes
    assert round(100 * db(1024, 64000, 64000, "fwd", 4) / 1.101e-3 / 3e12) == 16
    assert round(100 * db(1024, 64000, 64000, "fwd+bwd", 4) / 4.260e-3 / 3e12) == 10


def test_mlstm_quick_times_only_kspec_and_xl_chunk(families, bench):
    """--mlstm-quick (issue 29's speed table in under a minute): the option parses, and its variants are
    kspec's chunkwise op and mlstm_kernels xl_chunk at L=128 alone (no limit_chunk, no torch rows, whose
    torch.compile alone took tens of seconds), on the issue's three head-dim rows."""
    import argparse
    import types

    m = families["mlstm"]
    p = argparse.ArgumentParser()
    m.add_arguments(p)
    assert p.parse_args(["--mlstm-quick"]).mlstm_quick and not p.parse_args([]).mlstm_quick
    assert m.QUICK_DIMS == ((128, 128), (128, 256), (256, 512)) and m.QUICK_S == 4096
    ctx = types.SimpleNamespace(torch=None, kspec=types.SimpleNamespace(ops=None))
    peers = {"xl_chunk": object(), "limit_chunk": object()}
    names = [v[0] for v in m.variants(ctx, [m.QUICK_CHUNK], peers, quick=True)]
    assert names == ["kspec chunkwise L=128", "mlstm_kernels xl_chunk L=128"]


def test_mlstm_full_table_variants(families):
    """The default run times issue 29's columns at every shape: kspec at chunks 64/128/256, xl_chunk at
    64/128/256, limit_chunk, torch eager and torch.compile of the parallel form (no GPU: nothing is called)."""
    import types

    m = families["mlstm"]
    ctx = types.SimpleNamespace(torch=None, kspec=types.SimpleNamespace(ops=None, call=None))
    peers = {"xl_chunk": object(), "limit_chunk": object()}
    got = [(v[0], v[2], v[3]) for v in m.variants(ctx, list(m.KSPEC_CHUNKS), peers, compiled=object(),
                                                  dims=(128, 128))]
    assert got == [(f"kspec chunkwise L={L}", "kspec", L) for L in (64, 128, 256)] + \
        [(f"mlstm_kernels xl_chunk L={L}", "xl_chunk", L) for L in (64, 128, 256)] + \
        [("mlstm_kernels limit_chunk L=64", "limit_chunk", 64), ("torch eager (parallel)", "torch eager", None),
         ("torch.compile (parallel)", "torch.compile", None)]
    assert m.DEFAULT_CHUNK in m.KSPEC_CHUNKS
    configs = [v[0] for v in m.variants(ctx, [128], {}, torch_rows=False, dims=(256, 512), configs=True)]
    assert configs == ["kspec chunkwise L=128"] + [f"kspec L=128 {label}" for d, label, _, _ in m.CONFIG_ROWS
                                                   if d == (256, 512)]
    assert len(m.variants(ctx, [128], {}, torch_rows=False, dims=(256, 512))) == 1  # configs: on request
    no_torch = [v[0] for v in m.variants(ctx, [128], {}, torch_rows=False, dims=(64, 64))]
    assert no_torch == ["kspec chunkwise L=128"]


def test_mlstm_config_rows_are_valid_where_timed(families):
    """The kspec rows by explicit config (algo=tc_wide, tc_q128 and both beside the defaults) name values of
    the ops' algo axis, tc_wide and tc_q128 legal configs of cases at those head dims and chunks (the chunk
    128 rows themselves: Mlstm.WideStateTiles, Mlstm.ForwardOutputKernelOn128Rows), and join the variants of
    their shapes only."""
    import types

    import kspec

    m = families["mlstm"]
    for dims, label, fwd_config, bwd_config in m.CONFIG_ROWS:
        assert dims in ((128, 128), (128, 256), (256, 512))
        for op, config in (("mlstm.chunkwise.fwd", fwd_config), ("mlstm.chunkwise.bwd", bwd_config)):
            if config is None:
                continue
            names = dict(kspec.op_info(op)["tuning_names"])["algo"]
            algo, threads = (kv.split("=")[1] for kv in config.split(","))
            assert algo in names and threads == "128", (op, config)
    fwd = "mlstm.chunkwise.fwd"
    assert m._WIDE in set(kspec._C.configs_for_case(fwd, "dk_256_dv_512", "bf16"))
    assert m._WIDE in set(kspec._C.configs_for_case("mlstm.chunkwise.bwd", "dk_256_dv_512", "bf16"))
    assert m._Q128 in set(kspec._C.configs_for_case(fwd, "dk_128_dv_256_chunk_256", "bf16"))
    assert m._OVERLAP in set(kspec._C.configs_for_case("mlstm.chunkwise.bwd", "dh_64", "bf16"))
    ctx = types.SimpleNamespace(torch=None, kspec=types.SimpleNamespace(ops=None, call=None))
    for dims in ((128, 128), (128, 256), (256, 512)):
        names = [v[0] for v in m.variants(ctx, [128], {}, torch_rows=False, dims=dims, configs=True)]
        assert names == ["kspec chunkwise L=128"] + [f"kspec L=128 {label}" for d, label, _, _ in m.CONFIG_ROWS
                                                     if d == dims]


def _mlstm_row(m, group, kind, ms=None, L=None, status="ok", S=4096, dims=(256, 512)):
    r = {"shape": f"8x8x{S} {dims[0]}x{dims[1]}", "S": S, "DHQK": dims[0], "DHHV": dims[1], "B": 8, "kind": kind,
         "group": group, "chunk": L, "impl": "kspec" if group == "kspec" else "peer", "status": status,
         "variant": {"kspec": f"kspec chunkwise L={L}", "xl_chunk": f"mlstm_kernels xl_chunk L={L}",
                     "limit_chunk": "mlstm_kernels limit_chunk L=64"}.get(group, group),
         "flops": m.flops(8, 8, S, dims[0], dims[1], kind)}
    if ms is not None:
        r.update(gpu_ms=ms, ev_ms=ms)
    return r


def test_mlstm_summary_is_the_issue_table(families):
    """The summary line of a (S, head dims, kind): kspec's default and best chunk, xl_chunk per chunk with
    the best marked, limit_chunk, the torch rows' OOM, the best mlstm_kernels kernel (limit_chunk counts),
    both ratios against it and the 1.3x verdict; TFLOP/s by the issue's formula."""
    m = families["mlstm"]
    rows = [_mlstm_row(m, "kspec", "fwd", 2.6, 64), _mlstm_row(m, "kspec", "fwd", 2.5, 128),
            _mlstm_row(m, "kspec", "fwd", 2.2, 256), _mlstm_row(m, "xl_chunk", "fwd", 3.4, 64),
            _mlstm_row(m, "xl_chunk", "fwd", 3.2, 128), _mlstm_row(m, "xl_chunk", "fwd", 3.1, 256),
            _mlstm_row(m, "limit_chunk", "fwd", 2.9, 64), _mlstm_row(m, "torch eager", "fwd", status="OOM"),
            _mlstm_row(m, "torch.compile", "fwd", 80.0),
            _mlstm_row(m, "kspec", "fwd+bwd", 9.0, 128), _mlstm_row(m, "xl_chunk", "fwd+bwd", 9.7, 128)]
    m._ratios(rows)
    fwd, both = m.summary_rows(rows)
    assert (fwd["kind"], both["kind"]) == ("fwd", "fwd+bwd") and fwd["dims"] == "256x512"
    assert fwd["kspec_default"] == "2.500" and fwd["kspec_best"] == "2.200 (L=256)"
    assert (fwd["xl_64"], fwd["xl_128"], fwd["xl_256"]) == ("3.400", "3.200", "3.100*")
    assert fwd["limit_chunk"] == "2.900" and fwd["torch_eager"] == "OOM" and fwd["torch_compile"] == "80.000"
    assert fwd["best_peer"] == "2.900 (limit_chunk L=64)"
    assert fwd["x_default"] == pytest.approx(2.9 / 2.5) and fwd["x_best"] == pytest.approx(2.9 / 2.2)
    assert fwd["target"] == "ok" and both["target"] == "MISSED" and both["x_best"] == pytest.approx(9.7 / 9.0)
    assert fwd["kspec_tflops"] == pytest.approx(m.flops(8, 8, 4096, 256, 512, "fwd") / 2.2e-3 / 1e12)
    best = next(r for r in rows if r["gpu_ms"] == 2.2 if "gpu_ms" in r)
    assert best["best_marks"] == "+" and best["vs_best_peer"] == pytest.approx(2.9 / 2.2)
    lines = m.targets(rows)
    assert any("S=4096 256x512 fwd+bwd" in ln and "MISSED" in ln for ln in lines)


def test_mlstm_reps_by_size(families):
    """Short calls get up to MAX_REPS, long ones ~30 ms of GPU time a pass, never under MIN_REPS, one warm-up
    call: the default table's 72 rows (60 kernel rows, 12 torch rows at S = 4096) time in ~20 s of GPU even
    if every kernel row took 10 ms and every torch row 150 (the whole run's budget: 90 s with compiles)."""
    m = families["mlstm"]
    assert m.reps_for(0.4, 50) == (m.MAX_REPS, 1) == (20, 1)
    assert m.reps_for(0.4, 10) == (10, 1)
    assert m.reps_for(6.0, 50) == (5, 1)
    assert m.reps_for(150.0, 50) == (m.MIN_REPS, 1)

    def row_s(ms):
        reps, warmup = m.reps_for(ms, 50)
        return (2 * reps + warmup + 1) * ms / 1e3  # two passes, the warm-up and the validation call

    assert sum(row_s(10.0) for _ in range(60)) + sum(row_s(150.0) for _ in range(12)) < 25


def test_mlstm_warm_tasks_cover_every_peer_compile(families):
    """The warm-up workers compile each (S, head dims, chunk) xl_chunk runs at, limit_chunk per shape, the
    Triton step and torch.compile's graph, largest shapes first; --mlstm-quick's only its one chunk."""
    peers = sys.modules["kspec_bench.mlstm_peers"]
    tasks = peers.warm_tasks([4096, 8192], [(128, 128), (256, 512)])
    chunks = {(t["S"], t["DK"], t["DV"], t["L"]) for t in tasks if t["kind"] == "xl_chunk"}
    assert chunks == {(S, dk, dv, L) for S in (4096, 8192) for dk, dv in ((128, 128), (256, 512))
                      for L in (64, 128, 256)}
    assert sum(t["kind"] == "limit_chunk" for t in tasks) == 4
    assert tasks[0]["kind"] == "compile" and (tasks[1]["S"], tasks[1]["DK"]) == (8192, 256)
    assert {t["kind"] for t in tasks} == {"compile", "xl_chunk", "limit_chunk", "step"}
    quick = peers.warm_tasks([4096], [(128, 128)], [128], limit=False, compile_torch=False, step=False)
    assert quick == [{"kind": "xl_chunk", "S": 4096, "DK": 128, "DV": 128, "L": 128}]


def test_mlstm_warm_worker_runs_as_a_script():
    """mlstm_peers.py runs on its own (no package-relative import; its folder's jax.py and difflogic.py
    off sys.path): with no task it exits 0."""
    script = HERE / "mlstm_peers.py"
    r = subprocess.run([sys.executable, str(script), "[]"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_mlstm_torch_compile_graph_serves_every_shape(families):
    """torch.compile's dynamic graph, compiled first at mlstm_peers.GENERIC (every size distinct), serves the
    table's shapes (B = NH = 8, DHQK = DHHV, DHQK != DHHV, any S) without another compile (CPU, dynamo's
    counting backend); compiled first at a shape with DHQK = DHHV it would compile again at 128 x 256."""
    torch = pytest.importorskip("torch")
    import torch._dynamo.testing

    peers = sys.modules["kspec_bench.mlstm_peers"]
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    fn = peers.compiled_parallel(torch, backend=counter)
    peers.warm_compiled(torch, fn, "cpu", dtype=torch.float32)
    assert counter.frame_count == 2  # without and with grad
    for S, dk, dv in ((64, 128, 128), (96, 256, 512)):
        peers.warm_compiled(torch, fn, "cpu", dict(B=8, NH=8, S=S, DK=dk, DV=dv), torch.float32)
    assert counter.frame_count == 2
    torch._dynamo.reset()


def test_mlstm_step_rows_time_the_old_kernel_beside_the_default(families):
    """The step table's second kspec row forces mlstm.step's first kernel (algo=block, one CTA a sequence),
    the next ones algo=head and algo=cluster (one kernel); the default at the bench's shape (NH = 8, DH = 128, bf16) is
    algo=split: a gates kernel and the slab kernel (no GPU needed: the specializations compile)."""
    import kspec

    m = families["mlstm"]
    old = kspec.compile("mlstm.step", dtype="bf16", config=m.STEP_BLOCK, dhqk=128, dhhv=128)
    assert [r["kernel"].split("<")[0] for r in old] == ["kspec::mlstm_step_kernel"]
    for config in m.STEP_HEAD:  # one kernel, one CTA a sequence
        head = kspec.compile("mlstm.step", dtype="bf16", config=config, dhqk=128, dhhv=128)
        assert [r["kernel"].split("<")[0] for r in head] == ["kspec::mlstm_step_head_kernel"]
    for config in m.STEP_CLUSTER:  # one kernel, a cluster a sequence (sm_90)
        cl = kspec.compile("mlstm.step", dtype="bf16", arch="sm_90", config=config, dhqk=128, dhhv=128)
        assert [r["kernel"].split("<")[0] for r in cl] == ["kspec::mlstm_step_cluster_kernel"]
    new = kspec.compile("mlstm.step", dtype="bf16", dhqk=128, dhhv=128)
    assert [r["kernel"].split("<")[0] for r in new] == ["kspec::mlstm_step_gates_kernel",
                                                        "kspec::mlstm_step_cols_kernel"]


def test_torch_peers_of_the_new_families_match_the_references(families):
    """The torch eager implementations the benchmarks time (and torch.compile compiles) compute what the
    float64 references do: mLSTM's parallel form, mHC's pre/post, the logic layer (CPU, float64)."""
    torch = pytest.importorskip("torch")
    import numpy as np
    from kspec.reference import difflogic as dl_ref
    from kspec.reference import mhc as mhc_ref
    from kspec.reference import mlstm as mlstm_ref

    g = torch.Generator().manual_seed(0)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v, i, f = rn(1, 2, 40, 8), rn(1, 2, 40, 8), rn(1, 2, 40, 16), rn(1, 2, 40), rn(1, 2, 40) + 3
    h = families["mlstm"].torch_parallel(torch, q, k, v, i, f)
    want = mlstm_ref.mlstm_parallel_fwd(*(t.numpy() for t in (q, k, v, i, f)))[0]
    assert np.abs(h.numpy() - want).max() <= 1e-5 * np.abs(want).max()
    x, phi, alpha, bias, gamma = rn(5, 4, 8), 0.1 * rn(24, 32), rn(3).abs() + 0.5, 0.1 * rn(24), 1 + 0.1 * rn(32)
    y, h_pre, h_post, r = families["mhc"].torch_pre(torch, x, phi, alpha, bias, gamma)
    p = mhc_ref.mhc_pre_fwd(*(t.numpy() for t in (x, phi, alpha, bias, gamma)))
    for got, name in ((y, "y"), (h_pre, "h_pre"), (h_post, "h_post"), (r, "r")):
        assert np.abs(got.numpy() - p[name]).max() <= 1e-6 * np.abs(p[name]).max(), name
    fx = rn(5, 8)
    out = families["mhc"].torch_post(torch, x, fx, h_post, r)
    assert np.allclose(out.numpy(), mhc_ref.mhc_post_fwd(x.numpy(), fx.numpy(), p["h_post"], p["r"]))
    xs, logits = torch.rand(6, 9, generator=g, dtype=torch.float64), rn(12, 16)
    a, b = torch.randint(0, 9, (12,), generator=g), torch.randint(0, 9, (12,), generator=g)
    layer = families["difflogic"].torch_layer(torch, torch.tensor(dl_ref.TRUTH, dtype=torch.float64))
    assert np.allclose(layer(xs, logits, a, b).numpy(), dl_ref.layer_fwd(xs.numpy(), logits.numpy(), a.numpy(),
                                                                          b.numpy()))


def test_e79_cluster_config(families):
    cc = families["e79"].cluster_config
    assert cc(64, 1) == "split=8,cluster=1" and cc(64, 4) == "split=32,cluster=4" and cc(96, 8) is not None
    assert cc(48, 32) is None


def test_gpu_families_without_a_gpu_say_so(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(BENCH), "--family", "gemm,adamw", "--family", "e79", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 2, text
    assert "no GPU" in p.stderr and "Traceback" not in text, text
    errors = json.loads(out.read_text())["errors"]
    assert set(errors) == {"gemm", "adamw", "e79"} and all(e.startswith("no GPU") for e in errors.values())


def test_a_family_file_does_not_shadow_the_peer_package_of_its_name(tmp_path):
    """Run as a script, tools/bench is first on sys.path: difflogic.py and jax.py shadowed the peers'
    packages there (the H100 run saw "difflogic not importable"). The runner takes its folder off."""
    peer = tmp_path / "difflogic"
    peer.mkdir()
    (peer / "__init__.py").write_text("PEER = True\n")
    probe = ("import runpy, sys; script, folder = sys.argv[1:3]; sys.argv = [script, '--list']; "
             "sys.path.insert(0, folder); runpy.run_path(script, run_name='bench'); import difflogic; "
             "print(difflogic.PEER)")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", probe, str(BENCH), str(HERE)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr


def test_mhc_bench_references_run_on_the_cpu(families):
    """The mhc bench's float64 references (its validation before timing) on a tiny problem: the layer's
    pre backward once took the post's gradients positionally into the wrong slots (H100 run: ValueError)."""
    torch = pytest.importorskip("torch")
    mhc = families["mhc"]
    x = mhc._inputs(torch, "cpu", 8, 4, 16, 0)
    np = pytest.importorskip("numpy")
    want = mhc._ref(x, "fwd+bwd")
    assert {"dx", "dphi", "dalpha", "dbias"} <= set(want["layer"]) and want["layer"]["dx"].shape == (8, 4, 16)
    assert {"x_next", "y", "dx", "df", "dh_post", "dh_res", "dphi"} <= set(want["post_pre"])
    np.testing.assert_allclose(want["post_pre"]["x_next"], want["post"]["out"])
    # post_pre as post then pre (the peers' rows), on the bench's torch math
    pp = mhc._then(lambda *a: mhc.torch_pre(torch, *a, None), lambda *a: mhc.torch_post(torch, *a))
    got = pp(*(x[k].double() for k in ("x", "f", "h_post", "h_res", "phi", "alpha", "bias")))
    np.testing.assert_allclose(got[0][:mhc.CHECK_TOKENS].numpy(), want["post_pre"]["x_next"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1][:mhc.CHECK_TOKENS].numpy(), want["post_pre"]["y"], rtol=1e-6, atol=1e-6)


def test_mhc_bench_pre_kernel_configs_are_the_ops_legal_configs(families):
    """The mhc bench's pre.fwd rows by kernel name configs that the op accepts (each compiles, no GPU needed):
    algo=simt and every algo=mma token tile the rules allow; 64 tokens only for 16-bit x with D % 8 == 0;
    algo=mma_warp_heads at 32 and 64 of them for 16-bit x with M <= 32 (its kernel's last template argument)."""
    import kspec

    mhc = families["mhc"]
    assert list(mhc.pre_kernel_configs(4, 4096)) == [mhc.PRE_KERNELS + v for v in (
        "simt", "mma 16", "mma 32", "mma 64", "mma_warp_heads 32", "mma_warp_heads 64")]
    assert list(mhc.pre_kernel_configs(4, 37)) == [mhc.PRE_KERNELS + v for v in ("simt", "mma 16", "mma 32",
                                                                                 "mma_warp_heads 32")]
    assert list(mhc.pre_kernel_configs(4, 4096, "f32")) == [mhc.PRE_KERNELS + v for v in ("simt", "mma 16", "mma 32")]
    for n in (8, 4):
        for name, config in mhc.pre_kernel_configs(n, 128).items():
            kernels = [r["kernel"] for r in kspec.compile("mhc.pre.fwd", dtype="bf16", arch="sm_80", config=config,
                                                          n=n, D=128, t_max=20)]
            assert kernels and ("mma" in kernels[0]) == ("mma" in name), (name, kernels)
            assert kernels[0].endswith("true>") == ("warp_heads" in name), (name, kernels)


def test_mhc_bench_pre_ring_configs_compile_the_ring_kernel(families):
    """The mhc bench's 'kspec pre.fwd mma_ring …' rows: algo=mma_ring at 16 and 32 tokens where it is legal
    (16-bit x, D % 8 == 0, M <= 32), each accepted by mhc.pre.fwd and compiled (no GPU needed) as the tile
    kernel with its ring (kRing, the next-to-last template argument) and heads per warp (the last)."""
    import kspec

    mhc = families["mhc"]
    assert list(mhc.pre_ring_configs(4, 4096)) == [mhc.PRE_KERNELS + v for v in ("mma_ring 16", "mma_ring 32")]
    assert mhc.pre_ring_configs(4, 100) == {} and mhc.pre_ring_configs(5, 128) == {}
    assert mhc.pre_ring_configs(4, 4096, "f32") == {}
    for name, config in mhc.pre_ring_configs(4, 128).items():
        kernels = [r["kernel"] for r in kspec.compile("mhc.pre.fwd", dtype="bf16", arch="sm_80", config=config,
                                                      n=4, D=128, t_max=20)]
        assert kernels[0].startswith("kspec::mhc_pre_fwd_mma_kernel<") and kernels[0].endswith("true, true>"), kernels


def test_mhc_bench_pre_bwd_ring_configs_compile_the_ring_token_kernel(families):
    """The mhc bench's 'kspec pre.bwd mma_fused_ring …' rows: algo=mma_fused_ring at mma_fused_warp_heads' tile
    (none where that has none), accepted by mhc.pre.bwd and compiled (no GPU needed) with the token kernel's ring
    (kRing, its next-to-last template argument) and heads per warp (the last), then the fused kernel."""
    import kspec

    mhc = families["mhc"]
    assert mhc.pre_bwd_ring_configs(4, 4096) == {mhc.PRE_BWD_KERNELS + "mma_fused_ring 32": "algo=5,threads=128,tokens=32"}
    assert mhc.pre_bwd_ring_configs(4, 100) == {} and mhc.pre_bwd_ring_configs(5, 128) == {}
    for name, config in mhc.pre_bwd_ring_configs(4, 128).items():
        kernels = [r["kernel"] for r in kspec.compile("mhc.pre.bwd", dtype="bf16", arch="sm_80", config=config,
                                                      n=4, D=128, t_max=20)]
        assert kernels[0].startswith("kspec::mhc_pre_bwd_token_mma_kernel<") and kernels[0].endswith("true, true>")
        assert "fused_mma" in kernels[1], kernels


def test_mhc_bench_pre_bwd_ahead_configs_compile_the_ahead_fused_kernel(families):
    """The mhc bench's 'kspec pre.bwd mma_fused_ahead …' and '… mma_fused_phi_ring …' rows: algo=mma_fused_ahead
    and algo=mma_fused_phi_ring at mma_fused_warp_heads' tile and at 16 tokens (none where mma_fused_warp_heads has
    no tile), accepted by mhc.pre.bwd and compiled (no GPU needed) as the token kernel with heads per warp, no ring
    of rows and (phi_ring only) the phi ring (its last three template arguments), then the fused kernel with kAhead
    (its last)."""
    import kspec

    mhc = families["mhc"]
    assert mhc.pre_bwd_ahead_configs(4, 4096) == {
        mhc.PRE_BWD_KERNELS + f"{label} {t}": f"algo={algo},threads=128,tokens={t}"
        for label, algo in (("mma_fused_ahead", 6), ("mma_fused_phi_ring", 7)) for t in (32, 16)}
    assert list(mhc.pre_bwd_ahead_configs(2, 4096))[:2] == [mhc.PRE_BWD_KERNELS + v for v in ("mma_fused_ahead 64",
                                                                                              "mma_fused_ahead 16")]
    assert mhc.pre_bwd_ahead_configs(4, 100) == {} and mhc.pre_bwd_ahead_configs(5, 128) == {}
    for name, config in mhc.pre_bwd_ahead_configs(4, 128).items():
        kernels = [r["kernel"] for r in kspec.compile("mhc.pre.bwd", dtype="bf16", arch="sm_80", config=config,
                                                      n=4, D=128, t_max=20)]
        tail = "true, false, true>" if "phi_ring" in name else "false, false, true>"
        assert kernels[0].startswith("kspec::mhc_pre_bwd_token_mma_kernel<") and kernels[0].endswith(tail), kernels
        assert "fused_mma" in kernels[1] and kernels[1].endswith("true>"), kernels


def test_mhc_bench_pre_bwd_configs_compile_each_algo(families):
    """The mhc bench's pre fwd+bwd rows by mhc.pre.bwd config: algo=simt, algo=mma, algo=mma_tokens (at its
    largest legal token tile; none at n = 8 or D % 8 != 0) and algo=mma_fused (the same tile, M <= 24) each
    accepted and compiled (no GPU needed); algo=mma's columns kernel (the second) and its dx kernel (a fourth),
    algo=mma_tokens' token kernel, algo=mma_fused's token kernel and its fused kernel (three in all), and
    algo=mma_fused_warp_heads the same with the token kernel's last template argument true (heads per warp)."""
    import kspec

    mhc = families["mhc"]
    assert list(mhc.pre_bwd_configs(4, 4096)) == [mhc.PRE_BWD_KERNELS + v for v in (
        "simt", "mma", "mma_tokens 32", "mma_fused 32", "mma_fused_warp_heads 32")]
    assert list(mhc.pre_bwd_configs(2, 4096))[-1] == mhc.PRE_BWD_KERNELS + "mma_fused_warp_heads 64"
    assert list(mhc.pre_bwd_configs(4, 100)) == [mhc.PRE_BWD_KERNELS + v for v in ("simt", "mma")]
    assert not any("mma_fused" in name for name in mhc.pre_bwd_configs(5, 128))  # M = 35 > 24
    for n in (4, 8):
        configs = mhc.pre_bwd_configs(n, 128)
        assert any("mma_tokens" in name for name in configs) == (n == 4)
        for name, config in configs.items():
            kernels = [r["kernel"] for r in kspec.compile("mhc.pre.bwd", dtype="bf16", arch="sm_80", config=config,
                                                          n=n, D=128, t_max=20)]
            fused = "mma_fused" in name
            mma = "mma" in name and not fused
            assert len(kernels) == (4 if mma else 3) and ("columns_mma" in kernels[1]) == mma, (name, kernels)
            assert ("fused_mma" in kernels[1]) == fused, (name, kernels)
            assert ("token_mma" in kernels[0]) == ("mma_tokens" in name or fused), (name, kernels)
            assert kernels[0].endswith("true>") == ("warp_heads" in name), (name, kernels)


def test_mhc_bench_post_pre_kernel_configs_compile_the_mma_kernel(families):
    """The mhc bench's 'kspec post_pre …' rows: mhc.post_pre.fwd accepts each config (algo=mma and
    mma_warp_heads at the largest legal tile: 16 tokens at n = 4, 64 at n = 1, none for D % 8 != 0 or n = 8) and
    compiles the tensor-core kernel (no GPU needed)."""
    import kspec

    mhc = families["mhc"]
    assert list(mhc.post_pre_kernel_configs(4, 4096)) == [mhc.POST_PRE_KERNELS + v
                                                         for v in ("mma 16", "mma_warp_heads 16")]
    assert list(mhc.post_pre_kernel_configs(1, 128)) == [mhc.POST_PRE_KERNELS + v
                                                        for v in ("mma 64", "mma_warp_heads 64")]
    assert mhc.post_pre_kernel_configs(4, 100) == {} and mhc.post_pre_kernel_configs(8, 128) == {}
    assert list(mhc.post_pre_kernel_configs(6, 128)) == [mhc.POST_PRE_KERNELS + "mma 16"]  # M = 48 > 32
    for name, config in mhc.post_pre_kernel_configs(4, 128).items():
        kernels = [r["kernel"] for r in kspec.compile("mhc.post_pre.fwd", dtype="bf16", arch="sm_80", config=config,
                                                      n=4, D=128, t_max=20)]
        assert kernels == [k for k in kernels if "mhc_post_pre_fwd_mma_kernel" in k] and len(kernels) == 1, kernels
        assert kernels[0].endswith("true>") == ("warp_heads" in name), (name, kernels)


def test_mhc_bench_post_vec8_rows_take_the_vec_axis(families):
    """The mhc bench's 'kspec post vec 8' rows: mhc.post.fwd and mhc.post.bwd accept threads=128,vec=8 and compile
    the 8-wide kernels (no GPU needed)."""
    import kspec

    mhc = families["mhc"]
    assert mhc.POST_VEC8 == "kspec post vec 8"
    for op in ("mhc.post.fwd", "mhc.post.bwd"):
        kernels = [r["kernel"] for r in kspec.compile(op, dtype="bf16", arch="sm_80", config="threads=128,vec=8", n=4,
                                                      D=128)]
        assert kernels and kernels[0].endswith(", 128, 8>"), (op, kernels)


def test_torch_ca_peer_matches_the_reference(families):
    """The CA benchmark's torch eager peer (periodic and zero-padded) is the float64 reference's rollout."""
    torch = pytest.importorskip("torch")
    import numpy as np
    from kspec.reference import difflogic as dl_ref

    torch.manual_seed(0)
    for periodic in (False, True):
        ca = __import__("kspec").nn.DiffLogicCA(2, 2, (8, 4, 2), (6, 2), periodic=periodic).double()
        with torch.no_grad():
            ca.perception_logits.normal_(0, 2)
            ca.update_logits.normal_(0, 2)
        s0 = torch.rand(2, 3, 4, 2, dtype=torch.float64)
        got = families["difflogic"].torch_ca(torch, torch.tensor(dl_ref.TRUTH, dtype=torch.float64))(ca, s0, 2)
        w = ca.wires.numpy()
        layers = [(w[0, a:b], w[1, a:b]) for a, b in ((0, 4), (4, 6), (6, 12), (12, 14))]
        pl, ul = ca.perception_logits.detach().numpy(), ca.update_logits.detach().numpy()
        want = s0.numpy()
        for _ in range(2):
            want = dl_ref.ca_step(want, ca.perm.numpy(), layers[:2], layers[2:], [pl[:, :8], pl[:, 8:12], pl[:, 12:]],
                                  [ul[:6], ul[6:]], periodic=periodic)
        assert np.abs(got.detach().numpy() - want).max() <= 1e-12


def test_mhc_decode_table_and_peer_report(families):
    """The decode table says ok / MISSED against F.rms_norm per kspec.ops row; peer_report appends the shared
    columns and the absent peer's note."""
    mhc = families["mhc"]
    rows = [{"variant": "torch F.rms_norm [T, n·D]", "host_us": 10.0, "status": "ok"},
            {"variant": "kspec.ops.mhc_pre", "host_us": 9.0, "vs_peer": 0.9, "status": "ok"},
            {"variant": "kspec.ops.mhc_post", "host_us": 12.0, "vs_peer": 1.2, "status": "ok"}]
    sec = mhc._decode_section(rows)
    assert "mhc_pre ok" in sec.notes[-1] and "mhc_post MISSED" in sec.notes[-1]
    peer_report, PEER_COLUMNS = mhc.peer_report, sys.modules[mhc.peer_report.__module__].PEER_COLUMNS
    data, (s,) = peer_report("t", [("op", "op")], [{"op": "x", "status": "ok"}], ["n"], "no peer", ["target"])
    assert data == {"results": [{"op": "x", "status": "ok"}]} and s.notes == ["n", "peer absent: no peer", "target"]
    assert [c[0] for c in s.columns] == ["op"] + [c[0] for c in PEER_COLUMNS]


def test_record_failure_names_oom_and_releases_the_cache(families, capsys):
    """The failed-variant row the family files share: OOM told apart from other errors, the message kept,
    the traceback printed only with --verbose, torch's cache released when torch is given."""
    record_failure = sys.modules[families["mhc"].record_failure.__module__].record_failure
    released = []
    fake_torch = type("T", (), {"cuda": type("C", (), {"empty_cache": staticmethod(lambda: released.append(1))})})
    rows = []
    for err, verbose in ((RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), False),
                         (ValueError("bad shape"), True)):
        row = {}
        try:
            raise err
        except Exception as e:  # noqa: BLE001
            record_failure(row, e, verbose, fake_torch)
        rows.append(row)
    assert rows[0]["status"] == "OOM" and rows[0]["error"].startswith("RuntimeError: CUDA out of memory")
    assert rows[1] == {"status": "error", "error": "ValueError: bad shape"}
    assert released == [1, 1]
    err = capsys.readouterr().err
    assert "bad shape" in err and "out of memory" not in err  # the traceback of the verbose one only


def test_speedup_vs_kspec_matches_shape_and_kind(families):
    """Each timed row over the timed kspec row of its own shape and kind; untimed rows and rows without a
    kspec base get none."""
    speedup = sys.modules[families["mamba_block"].speedup_vs_kspec.__module__].speedup_vs_kspec
    rows = [{"impl": "kspec", "shape": "a", "kind": "fwd", "gpu_ms": 2.0},
            {"impl": "peer", "shape": "a", "kind": "fwd", "gpu_ms": 5.0},
            {"impl": "peer", "shape": "a", "kind": "fwd+bwd", "gpu_ms": 9.0},
            {"impl": "peer", "shape": "b", "kind": "fwd"}]
    speedup(rows)
    assert [r.get("kspec_speedup_gpu") for r in rows] == [1.0, 2.5, None, None]


def test_rel_error_takes_bfloat16_tensors(families):
    """mamba_block compares a bfloat16 (on the GPU, CUDA) tensor with a float64 one: numpy takes neither
    bfloat16 nor a CUDA tensor, so rel_error converts torch tensors itself (the H100 run's TypeError)."""
    torch = pytest.importorskip("torch")
    rel_error = sys.modules[families["mamba_block"].rel_error.__module__].rel_error
    ref = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    got = torch.tensor([[3.0, 4.5]], dtype=torch.bfloat16)
    assert rel_error(got, ref) == pytest.approx(0.1)
    assert rel_error(got.float().numpy(), ref.numpy()) == pytest.approx(0.1)
    assert rel_error(got[:, :1], ref) == float("inf")


def test_difflogic_parts_pick_the_tables(families, monkeypatch):
    """--difflogic-parts runs only the tables named (the lead times the layer alone, or the packed and CA
    tables with --quick), in the order layer, packed, ca, and merges their results."""
    import argparse

    dl = families["difflogic"]
    calls = []
    monkeypatch.setattr(dl, "run_layer", lambda ctx: (calls.append("layer"), ({"results": [1]}, ["L"]))[1])
    monkeypatch.setattr(dl, "run_packed", lambda ctx: (calls.append("packed"), ([2], "P"))[1])
    monkeypatch.setattr(dl, "run_ca", lambda ctx: (calls.append("ca"), ([3], "C"))[1])
    p = argparse.ArgumentParser()
    dl.add_arguments(p)
    assert p.parse_args([]).difflogic_lanes == "0,4,8,16,32" and p.parse_args([]).difflogic_ahead_lanes == ""
    ctx = argparse.Namespace(args=p.parse_args(["--difflogic-parts", "ca,packed"]))
    assert dl.run(ctx) == ({"packed": [2], "ca": [3]}, ["P", "C"]) and calls == ["packed", "ca"]
    calls.clear()
    ctx.args = p.parse_args([])
    assert dl.run(ctx) == ({"results": [1], "packed": [2], "ca": [3]}, ["L", "P", "C"])
    assert calls == ["layer", "packed", "ca"]


def test_difflogic_slow_calls_get_fewer_reps(families):
    """A call of SLOW_MS or more (the CA's BPTT at B = 256: 0.66 s; torch eager at 16k) is timed with about ROW_MS
    of calls, at least one rep, after one warm-up, from the faster of the validation call and one more (a first
    call may include compiling); a fast call keeps the run's reps and warm-up."""
    import argparse
    import types

    dl = families["difflogic"]
    clock = {"t": 0.0}
    seen = []

    class Timer:
        reps = 50

        def time(self, fn, prep, reps=None, warmup=None):
            seen.append((reps, warmup))
            return {"gpu_ms": 1.0}

    def ctx_with(call_ms):
        def fn():
            clock["t"] += call_ms / 1e3
        cuda = types.SimpleNamespace(synchronize=lambda: None)
        return argparse.Namespace(timer=Timer(), torch=types.SimpleNamespace(cuda=cuda)), fn

    real = dl.time.perf_counter
    dl.time.perf_counter = lambda: clock["t"]
    try:
        for first, call, want in [(2.0, 2.0, (None, None)), (5000.0, 2.0, (None, None)), (660.0, 660.0, (1, 1)),
                                  (170.0, 170.0, (2, 1)), (30.0, 25.0, (19, 1)), (12.0, 12.0, (41, 1))]:
            seen.clear()
            ctx, fn = ctx_with(call)
            dl.timed(ctx, fn, lambda: None, first)
            assert seen == [want], (first, call, seen)
    finally:
        dl.time.perf_counter = real


def test_difflogic_layer_configs_compile(families):
    """The layer table's configured rows name every axis of their op (a config lacking one is refused): the
    feature-major rows (the forward's stage=0, the backward's ahead) and the row-major flat row."""
    import kspec

    dl = families["difflogic"]
    fwd, bwd = dl.layer_configs(0)
    assert (fwd, bwd) == ("threads=256,lanes=0,stage=0", "threads=256,lanes=0,ahead=0,pool=0")
    fwd, bwd = dl.layer_configs(32, ahead=1)
    kernels = [r["kernel"] for r in kspec.compile("difflogic.layer.fwd", dtype="f32", arch="sm_90", config=fwd,
                                                  layout="feature_major")]
    assert kernels[1] == "kspec::difflogic_fwd_tiled_kernel<float, 256, 32>", kernels
    kernels = [r["kernel"] for r in kspec.compile("difflogic.layer.bwd", dtype="f32", arch="sm_90", config=bwd,
                                                  layout="feature_major")]
    assert kernels[1] == "kspec::difflogic_bwd_tiled_kernel<float, 256, 32, false, true>", kernels
    kernels = [r["kernel"] for r in kspec.compile("difflogic.layer.fwd", dtype="f32", arch="sm_90",
                                                  config=dl.FLAT_FWD_CONFIG)]
    assert kernels[1:] == ["kspec::difflogic_fwd_kernel<float, 256, false>"], kernels
    # h-dlr10's rows: the pooled backward (row-major dx), the staged forward writing xt, the cluster forward.
    for name, config in dl.POOL_CONFIGS.items():
        kernels = [r["kernel"] for r in kspec.compile("difflogic.layer.bwd", dtype="f32", arch="sm_90", config=config,
                                                      layout="feature_major", dx_layout="row_major")]
        assert kernels[1].startswith("kspec::difflogic_bwd_pool_kernel<float, "), (name, kernels)
    kernels = [r["kernel"] for r in kspec.compile("difflogic.layer.fwd", dtype="f32", arch="sm_90",
                                                  config=dl.STAGED_FWD.format(1), save_xt=True)]
    assert kernels[1] == "kspec::difflogic_fwd_staged_kernel<float, 1024, 4, true>", kernels
    for c in (2, 4):
        kernels = [r["kernel"] for r in kspec.compile("difflogic.layer.fwd", dtype="f32", arch="sm_90",
                                                      config=dl.STAGED_FWD.format(c), save_xt=True)]
        assert kernels[1] == f"kspec::difflogic_fwd_staged_cluster_kernel<float, 1024, {c}>", kernels
        assert kernels[-1] == "kspec::difflogic_transpose_kernel<float, 256, 64>", kernels
    # h-dl11's row: the hybrid forward (its own tables kernel with the packed wires), xt by the transpose.
    kernels = [r["kernel"] for r in kspec.compile("difflogic.layer.fwd", dtype="f32", arch="sm_90",
                                                  config=dl.HYBRID_FWD, save_xt=True)]
    assert kernels == ["kspec::difflogic_tables_wires_kernel<false, 256>",
                       "kspec::difflogic_fwd_hybrid_kernel<float, 1024>",
                       "kspec::difflogic_transpose_kernel<float, 256, 64>"], kernels


def test_difflogic_packed_net_configs_compile(families):
    """The packed table's "kspec net CFG" rows: each default config of --difflogic-net-configs is a legal
    difflogic.packed.net config and compiles (no GPU needed): algo=layers the per-layer kernels, chunked, chains
    early and fold the ops kernel and the network kernel of their chunk; and the per-layer rows kernel's row."""
    import argparse

    import kspec

    dl = families["difflogic"]
    p = argparse.ArgumentParser()
    dl.add_arguments(p)
    configs = p.parse_args([]).difflogic_net_configs.split(";")
    assert configs[0] == "algo=layers,chunk=128,inflight=2" and len(configs) >= 3
    for config in configs:
        kernels = [r["kernel"] for r in kspec.compile("difflogic.packed.net", dtype="f32", arch="sm_80", config=config)]
        if config.startswith("algo=layers"):
            assert kernels == ["kspec::difflogic_packed_fwd_kernel<32, 256>",
                               "kspec::difflogic_packed_group_sum_kernel<32, 256>"], kernels
        else:
            cfg = dict(kv.split("=") for kv in config.split(","))
            if cfg["algo"] in ("early", "early_late"):  # one kernel, the ticket order a parameter
                net = f"kspec::difflogic_packed_net_early_kernel<{cfg['chunk']}, 256>"
            elif cfg["algo"] in ("fold", "fold2"):  # 4 and 2 waves a last-layer item
                net = f"kspec::difflogic_packed_net_fold_kernel<{cfg['chunk']}, 256, {4 if cfg['algo'] == 'fold' else 2}>"
            else:
                chains = "true" if cfg["algo"] == "chains" else "false"
                net = f"kspec::difflogic_packed_net_kernel<{cfg['chunk']}, 256, {chains}>"
            assert kernels == ["kspec::difflogic_packed_ops_kernel<256>", net], kernels
    # the "kspec packed threads=128,vec=1" rows: packed.fwd's rows kernel
    kernels = [r["kernel"] for r in kspec.compile("difflogic.packed.fwd", dtype="f32", arch="sm_80", config=dl.ROWS_CONFIG,
                                                  tensor_dtypes={"x": "int64"})]
    assert kernels == ["kspec::difflogic_packed_fwd_rows_kernel<64, 128>"], kernels


def test_difflogic_ca_peer_is_the_same_ca(families):
    """The CA benchmark's difflogic 0.1.0 peer (its LogicLayers, the perception kernels with block wiring)
    computes the torch eager CA and sends the gradients to the kspec CA's logits: run here on a stand-in
    for difflogic (its LogicLayer's attributes, forward in torch: x[..., a], x[..., b] through softmax(weights));
    its reader lists are difflogic's (each input's gates ascending, a self-paired gate twice)."""
    torch = pytest.importorskip("torch")
    import types
    from kspec.reference import difflogic as dl_ref

    truth = torch.tensor(dl_ref.TRUTH, dtype=torch.float64)

    class LogicLayer(torch.nn.Module):
        def __init__(self, in_dim, out_dim, device="cpu", implementation="cuda"):
            super().__init__()
            assert device == "cpu" and implementation == "cuda"
            self.weights = torch.nn.Parameter(torch.randn(out_dim, 16))
            self.indices = (torch.zeros(out_dim, dtype=torch.int64),) * 2

        def forward(self, x):
            t = torch.softmax(self.weights, -1) @ truth
            xa, xb = x[..., self.indices[0]], x[..., self.indices[1]]
            return t[:, 0] * (1 - xa) * (1 - xb) + t[:, 1] * (1 - xa) * xb + t[:, 2] * xa * (1 - xb) + t[:, 3] * xa * xb

    dl = families["difflogic"]
    torch.manual_seed(0)
    for periodic in (False, True):
        ca = __import__("kspec").nn.DiffLogicCA(2, 2, (8, 4, 2), (6, 2), periodic=periodic).double()
        with torch.no_grad():
            ca.perception_logits.normal_(0, 2)
            ca.update_logits.normal_(0, 2)
        s0 = torch.rand(2, 3, 4, 2, dtype=torch.float64)
        peer = dl.difflogic_ca(torch, types.SimpleNamespace(LogicLayer=LogicLayer), ca)
        got = peer(s0, 2)
        want = dl.torch_ca(torch, truth)(ca, s0, 2)
        assert (got - want).abs().max().item() <= 1e-12
        g_got = torch.autograd.grad(got.sum(), (ca.perception_logits, ca.update_logits))
        g_want = torch.autograd.grad(want.sum(), (ca.perception_logits, ca.update_logits))
        assert all((a - b).abs().max().item() <= 1e-12 for a, b in zip(g_got, g_want))
    layer = dl._peer_layer(torch, types.SimpleNamespace(LogicLayer=LogicLayer), 3, torch.tensor([2, 0, 1]),
                           torch.tensor([2, 2, 0]))
    assert layer.given_x_indices_of_y_start.tolist() == [0, 2, 3, 6]
    assert layer.given_x_indices_of_y.tolist() == [1, 2, 2, 0, 0, 1]


def test_scan_configs_sweep_times_each_shape_beside_mamba(families, monkeypatch):
    """selective_scan_configs over several shapes (--scan-shape A,B) in one process: per shape the heuristic's
    config (marked) and the given ones, each checked against the float64 reference before it is timed, and
    mamba_ssm's forward where it is built, all timed together in rounds (the heuristic's first), whose gpu times
    over each config's fill the "heuristic ÷ this" and "mamba_ssm ÷ this" columns (no GPU: kspec, the peer and
    the timer are stand-ins computing the reference's out)."""
    import argparse
    import types

    torch = pytest.importorskip("torch")
    from kspec.reference import selective_scan as ref

    m = families["selective_scan_configs"]

    def reference_out(u, delta, A, B, C, D, z, delta_bias, *rest):
        f = lambda t: t.double().numpy()  # noqa: E731
        y, _ = ref.selective_scan_fwd(f(u), f(delta), f(A), f(B), f(C), f(D), f(z), f(delta_bias), True)
        return torch.from_numpy(y).to(u.dtype)

    calls = []

    def call(op, *args, config=None, delta_softplus=True, out=None):
        calls.append(config)
        return reference_out(*args), None, None

    heuristic = "algo=wide,warps=4,items=4,lanes=1,chunk=32,segs=1"
    monkeypatch.setattr(m, "_peer", lambda: lambda *a: reference_out(*a))
    times = iter([0.02, 0.03, 0.06] * 2)  # the heuristic's, the given config's, mamba_ssm's
    timed = []

    def time_rounds(steps):  # the shape's configs and the peer interleaved: one call, the heuristic's first
        timed.append(len(steps))
        for step in steps:
            step()
        ms = [next(times) for _ in steps]
        return [{"gpu_ms": t, "gpu_rounds_ms": [t, t, t], "x_gpu": t / ms[0]} for t in ms]
    p = argparse.ArgumentParser()
    m.add_arguments(p)
    args = p.parse_args(["--scan-shape", "1x8x16,2x4x24",
                         "--scan-config", "algo=tile,warps=4,items=4,lanes=1,chunk=32,segs=1"])
    args.quick, args.seed = False, 0
    explain = lambda *a, **k: f"config: {heuristic} (heuristic)"  # noqa: E731
    ctx = types.SimpleNamespace(torch=torch, dev="cpu", args=args, kspec=types.SimpleNamespace(call=call, explain=explain),
                                timer=types.SimpleNamespace(time_rounds=time_rounds))
    result, sections = m.run(ctx)
    rows = result["results"]
    assert [s.title for s in sections] == ["selective_scan.fwd configs, bf16, 1x8x16, dstate 16",
                                           "selective_scan.fwd configs, bf16, 2x4x24, dstate 16"]
    assert [(r["shape"], r["config"].split(",")[0], r["heuristic"], r["status"]) for r in rows] == [
        (s, c, h, "ok") for s in ("1x8x16", "2x4x24")
        for c, h in (("algo=wide", True), ("algo=tile", False), ("mamba_ssm", False))]
    assert [round(r["mamba_x"], 6) for r in rows] == [3.0, 2.0, 1.0] * 2
    assert [round(r["heuristic_x"], 6) for r in rows] == [1.0, round(2 / 3, 6), round(1 / 3, 6)] * 2
    assert timed == [3, 3]
    assert all(r["max_error"] < 1e-2 for r in rows)


def test_dispatch_step_rounds_interleave_and_rotate(families, monkeypatch):
    """The dispatch table's training steps: each group's variants run in rounds, in turn, round r starting at
    variant r, each variant under its own path context; a row's ratio is the median of its rounds' wall ratios
    to the first (peer) row of the group, so drift that slows a whole round leaves the ratio alone."""
    torch = pytest.importorskip("torch")
    dispatch = families["dispatch"]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    clock = [0]
    monkeypatch.setattr(dispatch.time, "perf_counter_ns", lambda: clock[0])
    order = []

    def variant(name, cost):
        def step():
            order.append(name)
            timed_round = max(len(order) - 4, 0) // 6  # after 3 warm-up steps, 3 variants x 2 steps a round
            clock[0] += cost * (1 + timed_round % 3)  # each round slower or faster as a whole
        return step
    entered = []

    class Ctx:
        def __enter__(self):
            entered.append("node")

        def __exit__(self, *exc):
            entered.append("exit")
    monkeypatch.setitem(dispatch._PATHS, "node", Ctx)
    variants = [(variant("peer", 1000), ""), (variant("kspec", 1500), ""), (variant("node", 500), "node")]
    out = dispatch.interleaved_steps(variants, rounds=3, steps=2, warmup=1)
    assert order[:3] == ["peer", "kspec", "node"]  # warm-up, each once
    timed = [n for n in order[3:]]
    firsts = [timed[i * 6] for i in range(3)]
    assert firsts == ["peer", "kspec", "node"], timed  # round r starts at variant r
    assert entered.count("node") == entered.count("exit") == 1 + 3
    (pw, ph, pr), (kw, kh, kr), (nw, nh, nr) = out
    assert pr == 1.0 and kr == pytest.approx(1.5) and nr == pytest.approx(0.5)
    assert (pw, kw, nw) == pytest.approx((2.0, 3.0, 1.0))  # µs per step, the median round's (x2)
    assert (ph, kh, nh) == (pw, kw, nw)


def _fake_cuda_timer(families, monkeypatch):
    """A GpuTimer on a simulated GPU clock (no spin): events read the clock, which the timed fns advance."""
    import importlib
    import types

    torch = pytest.importorskip("torch")
    timing = importlib.import_module(families["selective_scan"].__name__.rsplit(".", 1)[0] + ".timing")
    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    timer = object.__new__(timing.GpuTimer)
    timer.torch, timer.reps, timer.warmup = torch, 40, 1
    timer.flush_buf = types.SimpleNamespace(zero_=lambda: None)
    timer.start, timer.end = Event(), Event()
    timer.has_sleep, timer.cycles_per_us = False, 0.0
    return timer, clock


def test_time_rounds_interleaves_and_takes_the_ratio_per_round(families, monkeypatch):
    """GpuTimer.time_rounds (the scan bench's kspec and mamba_ssm rows): the fns in turn each round, round r
    starting at fn r; a row's time the median of its rounds' medians and its ratio to fns[0] the median of the
    rounds' ratios, so a slow stretch of the host that covers a few whole rounds decides neither (here rounds
    3-6 run everything 5x slower: a median of plain per-fn loops would put the peer in the slow stretch)."""
    order = []
    timer, clock = _fake_cuda_timer(families, monkeypatch)

    def fn(name, ms):
        def call():
            order.append(name)
            timed_round = (len(order) - 3) // 8  # after 2 warm-up calls, 2 fns x (2 gpu + 2 ev) a round
            clock[0] += ms * (5 if 3 <= timed_round <= 6 else 1)
        return call
    out = timer.time_rounds([fn("kspec", 1.0), fn("peer", 1.6)], rounds=10, per_round=2)
    assert order[:2] == ["kspec", "peer"]  # warm-up
    firsts = [order[2 + 8 * r] for r in range(10)]
    assert firsts == ["kspec", "peer"] * 5, order  # round r starts at fn r
    k, p = out
    assert k["x_gpu"] == k["x_ev"] == 1.0
    assert p["x_gpu"] == pytest.approx(1.6) and p["x_ev"] == pytest.approx(1.6)
    assert (k["ev_ms"], p["ev_ms"]) == pytest.approx((1.0, 1.6))  # the fast rounds' (6 of 10)
    assert k["ev_p90_ms"] == pytest.approx(5.0) and k["rounds"] == 10 and k["reps"] == 20


def test_scan_bench_times_kspec_and_mamba_in_rounds(families, monkeypatch):
    """The selective_scan family times a shape's kspec and mamba_ssm steps of one kind together
    (timer.time_rounds, kspec first: the base of the ratios), after checking each forward once against the
    float64 reference; the table's "kspec × (ev)" column is the rounds' ratio, and an impl whose forward
    raises is that row's error, not the others'."""
    import argparse
    import types

    torch = pytest.importorskip("torch")
    from kspec.reference import selective_scan as ref

    m = families["selective_scan"]

    def reference_out(u, delta, A, B, C, D, z, delta_bias, *rest):
        f = lambda t: t.detach().double().numpy()  # noqa: E731
        y, _ = ref.selective_scan_fwd(f(u), f(delta), f(A), f(B[:, 0]), f(C[:, 0]), f(D), f(z), f(delta_bias), True)
        return torch.from_numpy(y).to(u.dtype) + 0 * u  # differentiable: the fwd+bwd step runs backward()

    groups = []

    def time_rounds(steps):
        for s in steps:
            s()
        groups.append(len(steps))
        return [{"gpu_ms": 0.1 * (i + 1), "ev_ms": 0.3 * (i + 1), "x_gpu": 1.0 + i, "x_ev": 1.0 + 0.5 * i}
                for i in range(len(steps))]

    import builtins
    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "mamba_ssm.ops.selective_scan_interface":
            return types.SimpleNamespace(selective_scan_fn=reference_out)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    p = argparse.ArgumentParser()
    m.add_arguments(p)
    args = p.parse_args(["--scan-shapes", "1x4x16,2x3x8"])
    args.quick, args.seed, args.verbose, args.time_invalid, args.peak_tbps = False, 0, False, False, 3.0
    ctx = types.SimpleNamespace(torch=torch, dev="cpu", args=args, skipped=lambda impl: False,
                                kspec=types.SimpleNamespace(ops=types.SimpleNamespace(selective_scan_fn=reference_out)),
                                timer=types.SimpleNamespace(time_rounds=time_rounds))
    result, sections = m.run(ctx)
    rows = result["results"]
    # per shape and kind, kspec and mamba_ssm together, and with fwd+bwd the floors (a no-op autograd.Function, and
    # with the torch extension a no-op C++ node)
    floors = (m.FLOOR,) + ((m.FLOOR_CPP,) if m._cpp_floor() else ())
    assert groups == [2, 2 + len(floors), 2, 2 + len(floors)]
    assert [(r["shape"], r["impl"], r["kind"], r["status"]) for r in rows] == [
        (s, i, k, "floor" if i in floors else "ok") for s in ("1x4x16", "2x3x8") for k in ("fwd", "fwd+bwd")
        for i in ("kspec", "mamba_ssm") + (floors if k == "fwd+bwd" else ())]
    peer = [r for r in rows if r["impl"] == "mamba_ssm"]
    assert all(r["kspec_speedup_ev"] == 1.5 and r["kspec_speedup_gpu"] == 2.0 for r in peer)
    cols = [c[0] for c in sections[0].columns]
    assert "kspec × (ev)" in cols and "kspec × (gpu)" in cols
