"""The Python package and CLI without a GPU: registry, schemas, compile reports, errors mapped to
Python exceptions, the disk cache seen from a second process, precompile from a file, cache commands."""
import json
import os

import pytest

from helpers import cli

import kspec


def test_registry_lists_ops_with_schema():
    ops = kspec.list_ops()
    assert "norm_act.fwd" in ops and "norm_act.bwd" in ops
    info = kspec.op_info("norm_act.fwd")
    assert [t["name"] for t in info["inputs"]] == ["x", "weight", "bias"]
    assert info["inputs"][2]["optional"]
    assert {p["name"] for p in info["params"]} == {"norm", "act", "eps", "save_stats"}
    axes = dict(info["tuning_axes"])
    assert set(axes) == {"threads_per_row", "rows_per_block", "vec", "stream"}


def test_compile_report_and_memory_hit():
    r = kspec.compile("norm_act.fwd", dtype="bf16", arch="sm_90", hidden=4096, act="silu")
    assert len(r) == 1
    r = r[0]
    assert len(r["key"]) == 64 and r["source"] in ("compiled", "disk")
    assert r["registers"] > 0 and r["spill_bytes"] == 0 and r["shared_bytes"] >= 0
    assert r["arch"] == "sm_90a" and os.path.exists(r["path"])
    again = kspec.compile("norm_act.fwd", dtype="bf16", arch="sm_90", hidden=4096, act="silu")[0]
    assert again["source"] == "memory" and again["key"] == r["key"]


def test_errors_are_python_exceptions():
    with pytest.raises(ValueError, match="unknown op"):
        kspec.compile("norm_act.nope", dtype="f32", hidden=8)
    with pytest.raises(kspec.InvalidArgument, match="hidden"):
        kspec.compile("norm_act.fwd", dtype="f32")
    with pytest.raises(ValueError, match="parameter 'act'"):
        kspec.compile("norm_act.fwd", dtype="f32", hidden=8, act="swish")
    with pytest.raises(ValueError, match="not valid"):
        kspec.compile("norm_act.fwd", dtype="f32", hidden=33, config="threads_per_row=32,rows_per_block=1,vec=4,stream=0")
    with pytest.raises(ValueError, match="dtype"):
        kspec.compile("norm_act.fwd", dtype="int8", hidden=8)
    assert issubclass(kspec.CompileError, kspec.Error)
    assert issubclass(kspec.CacheError, OSError)
    assert issubclass(kspec.Unsupported, NotImplementedError)


def test_call_rejects_host_memory_and_bad_objects():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="input 'x': expected a CUDA tensor"):
        kspec.call("norm_act.fwd", np.zeros((2, 8), np.float32), np.ones(8, np.float32), None)
    with pytest.raises(TypeError, match="GPU tensor"):
        kspec.call("norm_act.fwd", [[1.0] * 8] * 2, np.ones(8, np.float32), None)


def test_cli_compile_json_then_second_process_hits_disk(tmp_path):
    env = {"KSPEC_CACHE_DIR": str(tmp_path / "c")}
    args = ["compile", "norm_act.fwd", "--dtype", "bf16", "--arch", "sm_90", "--param", "hidden=4096", "--json"]
    first = json.loads(cli(*args, env=env).stdout)
    for k in ("key", "source", "compile_ms", "registers", "spill_bytes", "shared_bytes", "path"):
        assert k in first
    assert first["source"] == "compiled" and first["compile_ms"] > 0
    second = json.loads(cli(*args, env=env).stdout)
    assert second["source"] == "disk" and second["key"] == first["key"] and second["compile_ms"] == 0


def test_cli_ops_doctor_and_cache_commands(tmp_path):
    env = {"KSPEC_CACHE_DIR": str(tmp_path / "c")}
    assert "norm_act.bwd" in cli("ops", env=env).stdout
    assert json.loads(cli("ops", "norm_act.fwd", "--json", env=env).stdout)[0]["name"] == "norm_act.fwd"
    doc = cli("doctor", env=env).stdout
    assert "nvrtc" in doc and "cache" in doc and "KSPEC_CACHE_DIR" in doc
    cli("compile", "norm_act.fwd", "--param", "hidden=64", env=env)
    stats = json.loads(cli("cache", "stats", "--json", env=env).stdout)
    assert stats["entries"] == 1 and stats["enabled"]
    assert "norm_act_fwd_kernel" in cli("cache", "list", "--json", env=env).stdout
    assert "1 entries ok" in cli("cache", "verify", env=env).stdout
    assert "pruned 1" in cli("cache", "prune", "--max-bytes", "0", env=env).stdout
    cli("compile", "norm_act.fwd", "--param", "hidden=64", env=env)
    assert "removed 1" in cli("cache", "clear", env=env).stdout


def test_cli_compile_verbose_shows_ptxas(tmp_path):
    out = cli("compile", "norm_act.bwd", "--dtype", "f16", "--param", "hidden=1000", "--param", "norm=rmsnorm",
              "--without", "bias", "--verbose", env={"KSPEC_CACHE_DIR": str(tmp_path / "c")}).stdout
    assert "registers" in out and "norm_act_bwd_reduce_kernel" in out and "ptxas" in out


def test_cli_precompile_from_file(tmp_path):
    reqs = tmp_path / "list.jsonl"
    reqs.write_text("\n".join(json.dumps(r) for r in [
        {"op": "norm_act.fwd", "dtype": "f16", "arch": "sm_80", "params": {"hidden": 100}},
        {"op": "norm_act.bwd", "dtype": "bf16", "arch": "sm_90", "params": {"hidden": 2048, "act": "gelu_erf"},
         "without": ["bias"]},
    ]))
    out = cli("precompile", "--file", str(reqs), "--jobs", "2", env={"KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert "2 requests, 3 kernels" in out.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"op": "norm_act.fwd", "params": {"hidden": 8, "act": "nope"}}))
    r = cli("precompile", "--file", str(bad), env={"KSPEC_CACHE_DIR": str(tmp_path / "c")}, check=False)
    assert r.returncode == 1 and "FAILED" in r.stderr


def test_cli_errors_are_clean(tmp_path):
    r = cli("compile", "nope.fwd", env={"KSPEC_CACHE_DIR": str(tmp_path / "c")}, check=False)
    assert r.returncode == 2 and "unknown op 'nope.fwd'" in r.stderr and "Traceback" not in r.stderr


def test_broken_template_gives_compile_error_with_source(tmp_path):
    import shutil

    root = os.path.join(os.path.dirname(__file__), "..", "..", "templates")
    tdir = tmp_path / "templates"
    shutil.copytree(root, tdir)
    with open(tdir / "norm_act" / "norm_act.cuh", "a") as f:
        f.write("\nstatic_assert(false, \"planted\");\n")
    r = cli("compile", "norm_act.fwd", "--param", "hidden=64",
            env={"KSPEC_CACHE_DIR": str(tmp_path / "c"), "KSPEC_TEMPLATE_DIR": str(tdir),
                 "KSPEC_DEBUG_DIR": str(tmp_path / "dbg")}, check=False)
    assert r.returncode == 3 and "CompileError" in r.stderr and "planted" in r.stderr
    written = list((tmp_path / "dbg").glob("kspec-failed-*.cu"))
    assert len(written) == 1 and "planted" in written[0].read_text()
    assert str(written[0]) in r.stderr


def test_no_gpu_run_precompiles(tmp_path):
    if kspec._C.doctor() and dict(kspec._C.doctor()).get("gpus", "0") != "0":
        pytest.skip("a GPU is present: `kspec run` checks instead")
    # The session's cache: tools/test.sh's final precompile for sm_90 then finds these on disk.
    r = cli("run", "--arch", "sm_90", "--output", str(tmp_path / "r.json"))
    assert "no GPU visible" in r.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["results"]) > 40 and not data["failures"]
