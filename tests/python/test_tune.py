"""kspec tune and the tuning database from Python and the CLI: export/import merges, concurrent
writers, a corrupt file, KSPEC_TUNE=off, a tuned entry changing what kspec.explain reports, stale
entries, compile-only pruning, the reports (CSV, JSON, PNG); on a GPU, a real tune that the next call uses."""
import json
import os
import subprocess
import sys

import pytest

from helpers import cli

import kspec
from kspec import tuning

REQ = dict(dtype="bf16", rows=3000, hidden=4096, norm="rmsnorm", act="silu")
TUNED = "threads_per_row=512,rows_per_block=1,vec=4,stream=0"


def explain_in_process(db, env=None, **req):
    """kspec.explain in a fresh process (the database is read once per process)."""
    code = ("import json, sys, kspec; e = kspec.explain('norm_act.fwd', **json.loads(sys.argv[1]));"
            "print(json.dumps(e.info))")
    e = dict(os.environ, KSPEC_TUNING_DB=str(db))
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", code, json.dumps(req or REQ)], capture_output=True, text=True, env=e)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout), r.stderr


def rkey(name):
    """A database key of a real op (kspec tune --import refuses keys of unknown ops)."""
    return f"norm_act.fwd|test-{name}#rows=1"


def cfg(n):
    """The n-th of a few configs in norm_act's tuning space (imports are checked against it)."""
    return f"threads_per_row={[32, 64, 128, 256, 512, 1024][n % 6]},rows_per_block=1,vec={[1, 2, 4, 8][n // 6 % 4]},stream=0"


def write_db(path, entries, gpu="NVIDIA H100 80GB HBM3"):
    with open(path, "w") as f:
        json.dump({"version": 1, "kind": "kspec-tuning", "gpu": gpu, "toolkit": "13.0", "entries": entries}, f)


def key_for(db, **req):
    info, _ = explain_in_process(db, **(req or REQ))
    return info["tuning_key"]


def test_a_tuned_entry_changes_the_explained_plan_and_off_ignores_it(tmp_path):
    db = tmp_path / "tuning.json"
    before, _ = explain_in_process(db)
    assert before["config_source"] == "heuristic" and before["tuning_db"] == str(db)
    assert before["config"] != TUNED
    write_db(db, {before["tuning_key"]: {"config": TUNED, "time_ms": 0.1}})
    after, _ = explain_in_process(db)
    assert after["config_source"] == "tuned" and after["config"] == TUNED
    assert ", 512, 1, 4>" in after["kernels"][0]["name"]
    assert "(tuned)" in after["text"] and after["kernels"][0]["cache_entry"].endswith(".bin")
    # a nearby shape (same power-of-two bucket) reuses it; another bucket does not
    near, _ = explain_in_process(db, **dict(REQ, rows=2500))
    assert near["config_source"] == "tuned"
    far, _ = explain_in_process(db, **dict(REQ, rows=5000))
    assert far["config_source"] == "heuristic"
    off, _ = explain_in_process(db, env={"KSPEC_TUNE": "off"})
    assert off["config_source"] == "heuristic" and off["config"] == before["config"]
    # kspec compile builds the tuned kernel too
    r = cli("compile", "norm_act.fwd", "--dtype", "bf16", "--param", "hidden=4096", "--param", "rows=3000",
            "--param", "norm=rmsnorm", "--param", "act=silu", "--json", env={"KSPEC_TUNING_DB": str(db)})
    assert json.loads(r.stdout)["config"] == TUNED


def test_corrupt_database_warns_once_is_ignored_and_kept(tmp_path):
    db = tmp_path / "tuning.json"
    db.write_text('{"version": 1, "entries": {"x": ')
    info, err = explain_in_process(db)
    assert info["config_source"] == "heuristic"
    assert err.count("KspecWarning") == 1 and "ignored" in err  # once, through Python's warnings
    assert db.read_text() == '{"version": 1, "entries": {"x": '
    # a writer keeps the unreadable file aside, then starts a valid one
    src = tmp_path / "in.json"
    write_db(src, {rkey("k"): {"config": cfg(1), "time_ms": 1.0}})
    cli("tune", "--import", str(src), env={"KSPEC_TUNING_DB": str(db)})
    assert (tmp_path / "tuning.json.corrupt").read_text() == '{"version": 1, "entries": {"x": '
    assert json.loads(db.read_text())["entries"][rkey("k")]["config"] == cfg(1)


def test_stale_entry_is_ignored_with_a_warning(tmp_path):
    db = tmp_path / "tuning.json"
    key = key_for(db)
    write_db(db, {key: {"config": "threads_per_row=256,rows_per_block=1,vec=8,stream=0,tile=64", "time_ms": 0.1}})
    info, err = explain_in_process(db)
    assert info["config_source"] == "heuristic"
    assert "tile" in info["note"] and "no longer applies" in err


def test_export_import_merge_keeps_the_faster_record(tmp_path):
    db = tmp_path / "db" / "tuning.json"
    env = {"KSPEC_TUNING_DB": str(db)}
    a = tmp_path / "a.json"
    write_db(a, {rkey("k1"): {"config": cfg(1), "time_ms": 2.0}, rkey("k2"): {"config": cfg(2), "time_ms": 1.0}})
    b = tmp_path / "b.json"
    write_db(b, {rkey("k1"): {"config": cfg(3), "time_ms": 1.5}, rkey("k2"): {"config": cfg(4), "time_ms": 3.0},
                 rkey("k3"): {"config": cfg(5), "time_ms": 1.0}})
    cli("tune", "--import", str(a), env=env)
    cli("tune", "--import", str(b), env=env)
    out = tmp_path / "exported.json"
    r = cli("tune", "--export", str(out), env=env)
    assert "exported 3 entries" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["version"] == 1
    assert {k: v["config"] for k, v in doc["entries"].items()} == {rkey("k1"): cfg(3), rkey("k2"): cfg(2),
                                                                  rkey("k3"): cfg(5)}
    r = cli("tune", "--list", env=env)
    assert cfg(5) in r.stdout
    assert cli("tune", "--db", env=env).stdout.strip() == str(db)


def test_import_into_a_directory_picks_the_file_of_the_exported_gpu(tmp_path):
    d = tmp_path / "dbdir"
    src = tmp_path / "h100.json"
    write_db(src, {rkey("k"): {"config": cfg(1), "time_ms": 1.0}})
    cli("tune", "--import", str(src), env={"KSPEC_TUNING_DB": str(d)})
    files = os.listdir(d)
    assert any(f.startswith("tuning-NVIDIA-H100-80GB-HBM3-cuda13.0") and f.endswith(".json") for f in files), files


def test_concurrent_writers_keep_every_entry(tmp_path):
    db = tmp_path / "tuning.json"
    procs = []
    for i in range(6):
        src = tmp_path / f"in{i}.json"
        write_db(src, {rkey(f"k{i}_{j}"): {"config": cfg(j), "time_ms": 1.0} for j in range(20)})
        procs.append(subprocess.Popen([sys.executable, "-m", "kspec", "tune", "--import", str(src)],
                                      env=dict(os.environ, KSPEC_TUNING_DB=str(db)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    doc = json.loads(db.read_text())
    assert len(doc["entries"]) == 120
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_compile_only_tune_prunes_and_compiles(tmp_path):
    r = kspec.tune("norm_act.fwd", "bf16", {"rows": 64, "hidden": 256}, compile_only=True, write_db=False)
    assert not r["timed"] and not r["written"]
    assert r["candidates"][0]["default"]
    statuses = {c["status"] for c in r["candidates"]}
    assert statuses <= {"pruned", "not timed"}
    pruned = [c for c in r["candidates"] if c["status"] == "pruned"]
    assert pruned and all(c["registers"] == -1 and c["why"] for c in pruned)
    assert any("1024 threads" in c["why"] for c in pruned)
    kept = [c for c in r["candidates"] if c["status"] == "not timed"]
    assert len(kept) > 1 and all(c["registers"] > 0 and c["spill_bytes"] == 0 for c in kept)
    out = cli("tune", "norm_act.fwd", "--dtype", "bf16", "--shape", "rows=64,hidden=256", "--compile-only",
              "--quiet", "--all-configs")
    assert "pruned" in out.stdout and "nothing timed" in out.stdout


def test_reports_csv_json_png(tmp_path):
    result = {"op": "norm_act.fwd", "shape": "rows=64,hidden=256", "gpu": "test", "best_config": "a=2",
              "default_config": "a=1", "default_ms": 2.0, "candidates": [
                  {"config": "a=1", "default": True, "status": "ok", "why": "", "median_ms": 2.0, "min_ms": 1.9,
                   "error": 0.0, "registers": 32, "spill_bytes": 0, "shared_bytes": 0, "compile_ms": 1.0},
                  {"config": "a=2", "default": False, "status": "ok", "why": "", "median_ms": 1.0, "min_ms": 0.9,
                   "error": 1e-3, "registers": 40, "spill_bytes": 0, "shared_bytes": 0, "compile_ms": 1.0},
                  {"config": "a=3", "default": False, "status": "pruned", "why": "too wide", "median_ms": -1,
                   "min_ms": -1, "error": -1, "registers": -1, "spill_bytes": -1, "shared_bytes": -1,
                   "compile_ms": 0}]}
    paths = tuning.write_report(result, str(tmp_path / "rep" / "norm"))
    png = ["norm.png"] if tuning.plotting_available() else []
    assert [os.path.basename(p) for p in paths] == ["norm.json", "norm.csv"] + png
    lines = open(paths[1]).read().splitlines()
    assert lines[0].startswith("config,default,status,median_ms") and lines[1].startswith("a=2,")
    assert len(lines) == 4 and "2.0" in lines[1]  # speedup of the winner over the default
    if png:
        assert open(paths[2], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.load(open(paths[0]))["best_config"] == "a=2"


def test_report_without_matplotlib_writes_no_png_and_says_so(tmp_path, monkeypatch):
    """Without the `plot` extra: JSON and CSV, no picture (not a blank one), and the CLI names the extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert not tuning.plotting_available()
    result = {"op": "norm_act.fwd", "shape": "rows=64,hidden=256", "gpu": "test", "best_config": "a=1",
              "default_config": "a=1", "default_ms": 2.0, "candidates": [
                  {"config": "a=1", "default": True, "status": "ok", "why": "", "median_ms": 2.0, "min_ms": 1.9,
                   "error": 0.0, "registers": 32, "spill_bytes": 0, "shared_bytes": 0, "compile_ms": 1.0}]}
    paths = tuning.write_report(result, str(tmp_path / "norm"))
    assert [os.path.basename(p) for p in paths] == ["norm.json", "norm.csv"]
    assert not (tmp_path / "norm.png").exists()
    code = ("import sys; sys.modules['matplotlib'] = None; from kspec.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "tune", "norm_act.fwd", "--dtype", "bf16", "--shape",
                        "rows=64,hidden=256", "--compile-only", "--quiet", "--report", str(tmp_path / "cli")],
                       capture_output=True, text=True, timeout=600)  # the session cache: compiled above
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kspec[plot]" in r.stderr and not (tmp_path / "cli.png").exists()
    assert (tmp_path / "cli.csv").exists() and (tmp_path / "cli.json").exists()


def test_tune_mode_knob_is_validated():
    r = subprocess.run([sys.executable, "-c", "import kspec; kspec.explain('norm_act.fwd', hidden=64)"],
                       capture_output=True, text=True, env=dict(os.environ, KSPEC_TUNE="sometimes"))
    assert r.returncode != 0 and "KSPEC_TUNE" in r.stderr
    names = [k[0] for k in kspec.knobs()]
    assert {"KSPEC_TUNE", "KSPEC_TUNING_DB", "KSPEC_TUNE_BUDGET"} <= set(names)


@pytest.mark.gpu
def test_gpu_tune_is_recorded_and_used_by_the_next_call(tmp_path):
    import torch
    from kspec.reference import norm_act as ref

    db = tmp_path / "tuning.json"
    code = r'''
import json, sys, torch, kspec
from kspec.reference import norm_act as ref
# without bias: the call below has none, and the presence of an optional input is part of the key
r = kspec.tune("norm_act.fwd", "bf16", {"rows": 200, "hidden": 1024}, budget=5, without=["bias"], norm="rmsnorm",
               act="silu")
x = torch.randn(200, 1024, device="cuda", dtype=torch.bfloat16)
w = 1 + 0.1 * torch.randn(1024, device="cuda", dtype=torch.bfloat16)
e = kspec.explain("norm_act.fwd", x, w, None, norm="rmsnorm", act="silu")
y, mean, rstd = kspec.call("norm_act.fwd", x, w, None, norm="rmsnorm", act="silu")
torch.cuda.synchronize()
print(json.dumps({"result": {k: r[k] for k in ("timed", "written", "key", "best_config", "best_ms", "default_ms")},
                  "source": e.config_source, "config": e.config, "key": e.tuning_key,
                  "ok": sum(c["status"] == "ok" for c in r["candidates"])}))
torch.save({"x": x.cpu(), "w": w.cpu(), "y": y.cpu()}, sys.argv[1])
'''
    saved = tmp_path / "io.pt"
    p = subprocess.run([sys.executable, "-c", code, str(saved)], capture_output=True, text=True,
                       env=dict(os.environ, KSPEC_TUNING_DB=str(db)))
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    r = out["result"]
    assert r["timed"] and r["written"] and r["best_ms"] > 0 and r["best_ms"] <= r["default_ms"]
    assert out["ok"] >= 2
    assert out["source"] == "tuned" and out["config"] == r["best_config"] and out["key"] == r["key"]
    assert r["key"] in json.loads(db.read_text())["entries"]
    d = torch.load(saved)
    y_ref = ref.norm_act_fwd(d["x"].double().numpy(), d["w"].double().numpy(), None, "rmsnorm", "silu", 1e-5)[0]
    import numpy as np
    y = d["y"].float().numpy()
    assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 1e-2


@pytest.mark.gpu
def test_gpu_auto_mode_tunes_on_first_use(tmp_path):
    db = tmp_path / "tuning.json"
    code = r'''
import json, torch, kspec
x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
w = torch.ones(512, device="cuda", dtype=torch.bfloat16)
y = kspec.call("norm_act.fwd", x, w, None, act="silu")[0]
torch.cuda.synchronize()
e = kspec.explain("norm_act.fwd", x, w, None, act="silu")
print(json.dumps({"source": e.config_source, "finite": bool(torch.isfinite(y.float()).all())}))
'''
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, KSPEC_TUNING_DB=str(db), KSPEC_TUNE="auto", KSPEC_TUNE_BUDGET="3"))
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"source": "tuned", "finite": True}
    assert len(json.loads(db.read_text())["entries"]) == 1


# ---- gemm: cuBLASLt algorithms as tuning configs ----

GEMM = dict(dtype="bf16", m=16384, n=4096, k=4096, without=["aux"])
ALGO = "algo=66,tile=20,stages=35,splitk=1,reduction=0,swizzle=1,custom=0,inner=0,cluster=2"


def explain_op_in_process(db, op, env=None, **req):
    code = ("import json, sys, kspec; a = json.loads(sys.argv[2]); e = kspec.explain(sys.argv[1], **a);"
            "print(json.dumps(e.info))")
    e = dict(os.environ, KSPEC_TUNING_DB=str(db))
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", code, op, json.dumps(req)], capture_output=True, text=True, env=e)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout), r.stderr


def test_gemm_cli_names_its_dims_and_params_like_the_other_ops():
    r = cli("tune", "gemm", "--dtype", "bf16", "--shape", "M=64,N=64,K=64", "--compile-only", check=False)
    assert r.returncode != 0 and "no dim 'M'" in r.stderr and "batch, wbatch, m, n, k" in r.stderr, r.stderr
    assert "act, tf32" in r.stderr  # where the epilogue goes
    r = cli("tune", "gemm", "--dtype", "bf16", "--shape", "m=64,n=64,k=64", "--param", "epilogue=bias_gelu",
            "--compile-only", check=False)
    assert r.returncode == 2 and "unknown parameter 'epilogue'" in r.stderr and "act" in r.stderr, r.stderr
    r = cli("tune", "gemm", "--dtype", "bf16", "--shape", "m=64,n=64,k=64", "--param", "act=swish",
            "--compile-only", check=False)
    assert r.returncode == 2 and "none, relu, gelu" in r.stderr, r.stderr
    r = cli("tune", "gemm", "--dtype", "bf16", "--shape", "m=64,n=64,k=64", "--candidates", "0", check=False)
    assert r.returncode != 0 and "--candidates" in r.stderr
    r = cli("tune", "gemm", "--dtype", "bf16", "--shape", "m=4097,n=4095,k=33", "--param", "act=gelu",
            "--without", "aux", "--compile-only", "--quiet")
    assert "candidates come from its library on the GPU" in r.stdout and "nothing timed" in r.stdout
    assert "unfused=1 (default)" in r.stdout  # GELU, n and k not multiples of 8: the plain GEMM, then kspec's kernel
    r = cli("tune", "gemm", "--dtype", "bf16", "--shape", "m=16384,n=4096,k=4096", "--param", "act=gelu",
            "--without", "aux", "--compile-only", "--quiet")
    assert "(cuBLASLt heuristic) (default)" in r.stdout


def test_gemm_record_round_trip_dispatch_choice_and_off(tmp_path):
    db = tmp_path / "tuning.json"
    before, _ = explain_op_in_process(db, "gemm", **GEMM)
    assert before["config_source"] == "heuristic" and before["config"] == "" and before["kernels"] == []
    assert before["tuning_key"].endswith("#batch=1,wbatch=1,m=16384,n=4096,k=4096")
    write_db(db, {before["tuning_key"]: {"op": "gemm", "config": ALGO, "time_ms": 0.7, "default_ms": 0.8}})
    after, _ = explain_op_in_process(db, "gemm", **GEMM)
    assert after["config_source"] == "tuned" and after["config"] == ALGO and "algo=66" in after["text"]
    near, _ = explain_op_in_process(db, "gemm", **dict(GEMM, m=9000))
    assert near["config_source"] == "tuned"
    gelu, _ = explain_op_in_process(db, "gemm", **dict(GEMM, act="gelu"))
    assert gelu["config_source"] == "heuristic"
    off, _ = explain_op_in_process(db, "gemm", env={"KSPEC_TUNE": "off"}, **GEMM)
    assert off["config_source"] == "heuristic" and off["config"] == ""
    listed = cli("tune", "--list", env={"KSPEC_TUNING_DB": str(db)})
    assert "algo=66" in listed.stdout
    # a record this kspec cannot read as an algorithm: ignored with one warning
    for bad in ("algo=66,tile=20", ALGO + ",turbo=1", ALGO.replace("splitk=1", "splitk=0")):
        write_db(db, {before["tuning_key"]: {"config": bad, "time_ms": 0.7}})
        info, err = explain_op_in_process(db, "gemm", **GEMM)
        assert info["config_source"] == "heuristic" and "tuned entry ignored" in info["note"], bad
        assert "no longer applies" in err, bad


def test_gemm_report_has_tflops_and_names_the_heuristic(tmp_path):
    result = {"op": "gemm", "shape": "batch=1,wbatch=1,m=4096,n=4096,k=4096", "gpu": "test", "best_config": ALGO,
              "default_config": "", "default_ms": 2.0, "candidates": [
                  {"config": "", "default": True, "status": "ok", "why": "", "median_ms": 2.0, "min_ms": 1.9,
                   "error": 0.0, "registers": -1, "spill_bytes": -1, "shared_bytes": -1, "compile_ms": 0},
                  {"config": ALGO, "default": False, "status": "ok", "why": "", "median_ms": 1.0, "min_ms": 0.9,
                   "error": 1e-3, "registers": -1, "spill_bytes": -1, "shared_bytes": -1, "compile_ms": 0}]}
    assert tuning.flops(result) == 2.0 * 4096 ** 3
    assert tuning.flops(dict(result, op="gemm.bwd")) == 4.0 * 4096 ** 3
    assert tuning.flops(dict(result, op="norm_act.fwd")) == 0
    rows = tuning.table_rows(result)
    assert rows[0]["config"] == ALGO and abs(rows[0]["tflops"] - 2 * 4096 ** 3 / 1e9) < 1e-6
    assert tuning.config_label(result, "") == "(cuBLASLt heuristic)"
    paths = tuning.write_report(result, str(tmp_path / "gemm"))
    lines = open(paths[1]).read().splitlines()
    assert lines[0].endswith(",tflops") and lines[1].startswith('"algo=66')


@pytest.mark.gpu
def test_gpu_gemm_tune_is_recorded_used_by_dispatch_and_matches_float64(tmp_path):
    db = tmp_path / "tuning.json"
    code = r'''
import json, sys, torch, kspec
from kspec.reference import gemm as ref
r = kspec.tune("gemm", "bf16", {"m": 1000, "n": 768, "k": 96}, act="gelu", without=["aux"], budget=10, candidates=8)
x = torch.randn(1000, 96, device="cuda").to(torch.bfloat16)
w = (torch.randn(768, 96, device="cuda") * 0.1).to(torch.bfloat16)
b = torch.randn(768, device="cuda").to(torch.bfloat16)
e = kspec.explain("gemm", x, w, b, act="gelu")
y = kspec.call("gemm", x, w, b, act="gelu")[0]
want = ref.gemm_fwd(x.double().cpu().numpy(), w.double().cpu().numpy(), b.double().cpu().numpy(), "gelu")[0]
err = float(((y.double().cpu().numpy() - want) ** 2).sum() ** 0.5 / (want ** 2).sum() ** 0.5)
print(json.dumps({"result": {k: r[k] for k in ("timed", "written", "key", "best_config", "best_ms", "default_ms")},
                  "ok": sum(c["status"] == "ok" for c in r["candidates"]),
                  "errors": [c["error"] for c in r["candidates"] if c["status"] == "ok"],
                  "source": e.config_source, "config": e.config, "key": e.tuning_key, "err": err}))
'''
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, KSPEC_TUNING_DB=str(db)))
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    r = out["result"]
    assert r["timed"] and r["written"] and 0 < r["best_ms"] <= r["default_ms"]
    assert out["ok"] >= 2 and max(out["errors"]) <= 1e-2
    assert out["source"] == "tuned" and out["config"] == r["best_config"] and out["key"] == r["key"]
    assert json.loads(db.read_text())["entries"][r["key"]]["config"] == r["best_config"]
    assert out["err"] <= 1e-2
