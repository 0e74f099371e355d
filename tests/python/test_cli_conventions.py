"""Issue 31, the CLI's conventions, without a GPU: --version; --json a boolean flag on every command
(JSON, only JSON, on stdout) and --output FILE where a file is wanted; help on every option; expected
errors in one line on stderr with distinct exit codes (listed in --help), no traceback, also when stdout
is closed early; doctor's typed JSON and its real write test of the cache directory; the quick
precompile that is the main job without a GPU."""
import argparse
import json
import os
import subprocess
import sys

import pytest

import helpers

import kspec
from kspec import cli as kcli


def run(*args, env=None, timeout=600):
    return helpers.cli(*args, env=env, check=False, timeout=timeout)


def inproc(capsys, *args):
    """kspec's CLI in this process (no interpreter start): (exit code, stdout, stderr)."""
    try:
        code = kcli.main(list(args))
    except SystemExit as e:  # argparse: --help, --version, a bad command line
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def subparsers():
    p = kcli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return p, sub.choices


def test_version(capsys):
    code, out, err = inproc(capsys, "--version")
    assert code == 0 and out.strip() == f"kspec {kspec.__version__}", out + err


def test_every_option_has_help_and_json_is_a_flag_everywhere():
    p, subs = subparsers()
    assert set(subs) == {"ops", "compile", "precompile", "cache", "doctor", "check", "run", "tune"}
    for name, s in [("kspec", p)] + list(subs.items()):
        for a in s._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help, f"{name}: {a.option_strings or a.dest} has no help text"
    for name, s in subs.items():
        js = [a for a in s._actions if "--json" in a.option_strings]
        assert len(js) == 1 and isinstance(js[0], argparse._StoreTrueAction), name
        out = [a for a in s._actions if "--output" in a.option_strings]
        assert all(a.metavar == "FILE" for a in out), name
    for name in ("precompile", "check", "run", "tune"):
        assert any("--output" in a.option_strings for a in subs[name]._actions), name


def test_help_lists_the_exit_codes(capsys):
    rc, out, _ = inproc(capsys, "--help")
    assert rc == 0
    for code, _ in kcli.EXIT_CODES:
        assert f"  {code} " in out, out
    codes = [c for c, _ in kcli.EXIT_CODES]
    assert len(codes) == len(set(codes))


def test_precompile_defaults_compiles_each_case_default_plan(tmp_path):
    """`--defaults ARCH` (CI's sm_80 sweep): every case x dtype with dispatch's config, beside --all's sweep."""
    env = {"KSPEC_CACHE_DIR": str(tmp_path / "c")}
    r = run("precompile", "--defaults", "sm_80", "--op", "norm_act.fwd", "--json", env=env)
    d = json.loads(r.stdout)
    assert r.returncode == 0 and not d["failures"], r.stdout + r.stderr
    assert d["archs"] == ["sm_80"] and d["requests"] > 3  # more than the quick plan's one call a dtype
    assert {x["arch"] for x in d["results"]} == {"sm_80"}
    r = run("precompile", "--all", "--arch", "sm_90", "--defaults", "sm_80", "--op", "norm_act.fwd", "--json", env=env)
    both = json.loads(r.stdout)
    assert r.returncode == 0 and both["archs"] == ["sm_90", "sm_80"], r.stdout + r.stderr
    assert {x["arch"] for x in both["results"]} == {"sm_80", "sm_90a"}
    assert both["requests"] > d["requests"]


@pytest.mark.parametrize("args, code, needle", [
    (["compile", "norm_act.fwd", "--arch", "sm_50", "--param", "hidden=64"], kcli.EXIT_USAGE, "sm_50"),
    (["compile", "nope.fwd"], kcli.EXIT_USAGE, "unknown op 'nope.fwd'"),
    (["compile", "norm_act.fwd", "--param", "hidden"], kcli.EXIT_USAGE, "--param expects name=value"),
    (["tune"], kcli.EXIT_USAGE, "give an OP"),
    (["precompile", "--file", "/nonexistent/list.jsonl"], kcli.EXIT_USAGE, "cannot read it"),
    (["precompile", "--file", "x.jsonl", "--defaults", "sm_80"], kcli.EXIT_USAGE, "not both"),
    (["check"], kcli.EXIT_CUDA, "no GPU visible"),
    (["frobnicate"], kcli.EXIT_USAGE, "invalid choice"),
])
def test_expected_errors_are_one_line_on_stderr_with_their_exit_code(args, code, needle, capsys):
    if args == ["check"] and kspec._C.doctor() and dict(kspec._C.doctor()).get("gpus", "0") != "0":
        pytest.skip("a GPU is present")
    rc, out, err = inproc(capsys, *args)
    assert rc == code, f"exit {rc}: {out}{err}"
    assert needle in err and "Traceback" not in err and out == "", out + err


def test_check_of_a_named_op_that_runs_no_case_is_an_error(capsys, monkeypatch):
    # Without this, `kspec check --op difflogic.packed.net` (no generic cases) printed "0 passed, 0 failed" and
    # exited 0, and three sanitizer runs around it checked nothing (session 9, run 27).
    monkeypatch.setattr(kcli, "_gpu_count", lambda: 1)
    monkeypatch.setattr(kcli._C, "check_op", lambda *a: [])
    rc, out, err = inproc(capsys, "check", "--op", "difflogic.packed.net")
    assert rc == kcli.EXIT_USAGE and "difflogic.packed.net ran no case" in err and "Traceback" not in err, out + err


def test_check_says_how_far_it_is_op_by_op_on_stderr(capsys, monkeypatch):
    # A first `kspec run` on a GPU compiles every case's kernels for minutes; the table comes at the end, so each
    # op prints a line as it finishes (stderr; nothing of it with --json).
    monkeypatch.setattr(kcli, "_gpu_count", lambda: 1)
    fake = lambda op, *a: [{"op": op, "case": "base", "dtype": "f32", "shape": "-", "config": "-", "errors": [("y", 1e-7)],
                            "tolerance": 1e-5, "passed": op != "mhc.post.fwd", "message": "off" if op == "mhc.post.fwd" else ""}]
    monkeypatch.setattr(kcli._C, "check_op", fake)
    rc, out, err = inproc(capsys, "check", "--op", "norm_act.fwd", "--op", "mhc.post.fwd")
    assert rc == kcli.EXIT_FAILED, out + err
    assert "[1/2] norm_act.fwd: 1/1 passed" in err and "[2/2] mhc.post.fwd: 0/1 passed" in err, err
    assert "1 passed, 1 failed" in out
    rc, out, err = inproc(capsys, "check", "--op", "norm_act.fwd", "--json")
    assert rc == kcli.EXIT_OK and err == "" and json.loads(out)[0]["op"] == "norm_act.fwd", out + err


def test_an_error_in_a_fresh_process_has_no_traceback(tmp_path):
    r = run("compile", "norm_act.fwd", "--arch", "sm_50", "--param", "hidden=64",
            env={"KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == kcli.EXIT_USAGE and r.stderr.count("\n") == 1 and "sm_50" in r.stderr, r.stderr


def test_closed_stdout_is_no_traceback():
    # The reader is gone before kspec writes (its end of the pipe is closed at once): `kspec ops | head -0`.
    p = subprocess.Popen([sys.executable, "-m", "kspec", "ops", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == kcli.EXIT_PIPE, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_doctor_json_is_typed_and_the_cache_really_written(tmp_path):
    r = run("doctor", "--json", env={"KSPEC_CACHE_DIR": str(tmp_path / "new" / "cache"), "KSPEC_TUNE": "off"})
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert isinstance(d["gpu_count"], int) and isinstance(d["gpus"], list)
    c = d["cache"]
    assert isinstance(c["entries"], int) and isinstance(c["max_bytes"], int) and isinstance(c["enabled"], bool)
    assert c["write_test"] == {"ok": True, "error": None}
    assert (tmp_path / "new" / "cache").is_dir() and not os.listdir(tmp_path / "new" / "cache")  # probe removed
    env = d["environment"]
    assert env["KSPEC_TUNE"] == "off" and env["KSPEC_VERBOSE"] is None and "KSPEC_CACHE_DIR" in env
    # A directory that cannot be created (below a regular file, which even root cannot get round) is a
    # failed check, though the cache's own bookkeeping still calls it writable.
    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "cache")
    r = run("doctor", "--json", env={"KSPEC_CACHE_DIR": bad})
    assert r.returncode == kcli.EXIT_FAILED, r.stdout + r.stderr
    assert json.loads(r.stdout)["cache"]["write_test"]["ok"] is False
    r = run("doctor", env={"KSPEC_CACHE_DIR": bad})
    assert r.returncode == kcli.EXIT_FAILED and "cache write test" in r.stdout and "FAILED" in r.stdout


def test_json_on_cache_verify_and_prune(capsys):
    rc, out, _ = inproc(capsys, "cache", "verify", "--json")  # the session's cache
    d = json.loads(out)
    assert rc in (0, 1) and isinstance(d["ok"], int) and d["bad"] == len(d["problems"])
    rc, out, _ = inproc(capsys, "cache", "prune", "--json", "--max-bytes", str(1 << 40))
    assert rc == 0 and json.loads(out) == {"pruned": 0}


def test_json_on_tune_list_and_db(tmp_path):
    env = {"KSPEC_TUNING_DB": str(tmp_path / "db.json")}
    r = run("tune", "--list", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout) == {}, r.stdout + r.stderr
    r = run("tune", "--list", "--output", str(tmp_path / "entries.json"), env=env)
    assert r.returncode == 0 and json.loads((tmp_path / "entries.json").read_text()) == {}
    assert json.loads(run("tune", "--db", "--json", env=env).stdout) == {"db": str(tmp_path / "db.json")}


def test_quick_precompile_makes_the_typical_call_a_cache_hit(tmp_path):
    """`kspec precompile` (the main job without a GPU): one typical specialization per op and dtype, a
    table, the cache's place; afterwards the call a user types first is read from disk."""
    env = {"KSPEC_CACHE_DIR": str(tmp_path / "c")}
    r = run("precompile", "--op", "norm_act.fwd", "--arch", "sm_90", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "regs" in r.stdout and "spill" in r.stdout and f"cache: {tmp_path / 'c'}" in r.stdout
    assert "kspec precompile: 3 requests" in r.stdout  # f32, f16, bf16
    r = run("compile", "norm_act.fwd", "--dtype", "bf16", "--param", "hidden=4096", "--param", "act=silu",
            "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["source"] == "disk", r.stdout + r.stderr
    r = run("precompile", "--op", "norm_act.fwd", "--arch", "sm_90", "--json", env=env)
    d = json.loads(r.stdout)  # only JSON on stdout
    assert r.returncode == 0 and d["requests"] == 3 and d["cache_dir"] == str(tmp_path / "c")
    assert {x["source"] for x in d["results"]} <= {"disk", "memory"} and not d["failures"]
