"""Adversarial input from the CLI and Python (issue 26): environment knobs with values they do not take,
dims, params, configs and archs outside the schema, hostile tuning imports. Each must end the command
with a clear message naming what was wrong and an ordinary exit status: never an abort (134), a
segfault (139) or a traceback."""
import json
import os
import subprocess
import sys

import pytest

import helpers

import kspec

COMPILE = ["compile", "norm_act.fwd", "--dtype", "bf16", "--param", "hidden=64"]


def cli(*args, env=None, timeout=120):
    return helpers.cli(*args, env=env, check=False, timeout=timeout)


def assert_clean_failure(r, *fragments):
    out = r.stdout + r.stderr
    assert r.returncode in (1, 2, 5), f"exit {r.returncode}:\n{out}"  # kspec.cli.EXIT_*: found, usage, file
    assert "Traceback" not in out, out
    for f in fragments:
        assert f in out, f"missing {f!r} in:\n{out}"


# ---- knobs ----

@pytest.mark.parametrize("name,value,takes", [
    ("KSPEC_CACHE", "maybe", "on/off"),
    ("KSPEC_TUNE", "sometimes", "auto"),
    ("KSPEC_VERBOSE", "loud", "an integer"),
    ("KSPEC_COMPILE_THREADS", "0", "1..1024"),
    ("KSPEC_CACHE_MAX_BYTES", "-1", "an integer"),
    ("KSPEC_TUNE_BUDGET", "soon", "positive number"),
])
def test_bad_knob_fails_compile_with_its_name(name, value, takes):
    assert_clean_failure(cli(*COMPILE, env={name: value}), name, takes, repr(value))


def test_knobs_take_any_case_and_every_boolean_spelling():
    # KSPEC_CACHE=OFF aborted the process (exit 134): an exception escaped std::call_once.
    r = cli(*COMPILE, "--json", env={"KSPEC_CACHE": "OFF", "KSPEC_TUNE": "No", "KSPEC_VERBOSE": "off"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["path"] == ""  # memory only


def test_bad_knob_fails_precompile_and_tune_without_aborting(tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps({"op": "norm_act.fwd", "dtype": "bf16", "params": {"hidden": 64}}) + "\n")
    assert_clean_failure(cli("precompile", "--file", str(reqs), env={"KSPEC_CACHE": "maybe"}), "KSPEC_CACHE")
    # the tuner compiles on several threads: an exception there terminated the process
    r = cli("tune", "norm_act.fwd", "--param", "hidden=256", "--param", "rows=64", "--compile-only", "--no-save",
            "-q", env={"KSPEC_CACHE": "maybe", "KSPEC_COMPILE_THREADS": "2"})
    assert_clean_failure(r, "KSPEC_CACHE")


def test_bad_knob_fails_explain_in_python_every_time():
    code = ("import kspec\n"
            "for _ in range(2):\n"
            "    try:\n"
            "        kspec.explain('norm_act.fwd', dtype='bf16', rows=3, hidden=64)\n"
            "    except kspec.InvalidArgument as e:\n"
            "        print('InvalidArgument:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, KSPEC_TUNE="sometimes"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("InvalidArgument: KSPEC_TUNE: expected auto or on/off") == 2, r.stdout


# ---- dims, params, configs, archs: checked against the schema before any compile ----

@pytest.mark.parametrize("args,fragments", [
    (["--param", "hidden=0"], ["dim 'hidden'", "1..2147483647", "got 0"]),
    (["--param", "hidden=-1"], ["dim 'hidden'", "got -1"]),
    (["--param", f"hidden={2 ** 40}"], ["dim 'hidden'", f"got {2 ** 40}"]),
    (["--param", "hidden=1234567890123456789012345"], ["'hidden'", "64-bit"]),
    (["--param", "hidden=64", "--param", "eps=-1"], ["parameter 'eps'", ">= 0"]),
    (["--param", "hidden=64", "--param", "eps=nan"], ["parameter 'eps'", "finite"]),
    (["--param", "hidden=64", "--param", "eps=inf"], ["parameter 'eps'", "finite"]),
    (["--param", "hidden=64", "--arch", "sm_99999999999999999999"], ["arch", "out of range"]),
    (["--param", "hidden=64", "--config", "threads_per_row=32,rows_per_block=4,vec=4,stream=0,bogus=3"],
     ["'bogus' is not an axis"]),
    (["--param", "hidden=64", "--config", "threads_per_row=33,rows_per_block=4,vec=4,stream=0"],
     ["threads_per_row=33"]),
])
def test_out_of_schema_request_is_refused_before_compiling(args, fragments):
    r = cli("compile", "norm_act.fwd", "--dtype", "bf16", *args, "--json")
    assert_clean_failure(r, *fragments)
    assert "nvrtc" not in (r.stdout + r.stderr).lower()


def test_python_api_names_the_argument():
    for bad, fragment in [(dict(hidden=0), "dim 'hidden'"), (dict(hidden=10 ** 25), "'hidden'"),
                          (dict(hidden=64, eps=float("nan")), "parameter 'eps'")]:
        with pytest.raises(kspec.InvalidArgument, match=fragment):
            kspec.compile("norm_act.fwd", "bf16", **bad)
    with pytest.raises(kspec.InvalidArgument, match="chunk"):
        kspec.compile("e79.fwd", "bf16", n=32, chunk=0)


# ---- kspec tune --import ----

def _doc(entries):
    return {"version": 1, "kind": "kspec-tuning", "gpu": "NVIDIA H100 80GB HBM3", "toolkit": "13.0",
            "entries": entries}


GOOD = "threads_per_row=128,rows_per_block=1,vec=8,stream=0"


def test_import_of_a_missing_file_is_an_error(tmp_path):
    db = tmp_path / "db.json"
    r = cli("tune", "--import", str(tmp_path / "nowhere.json"), env={"KSPEC_TUNING_DB": str(db)})
    assert_clean_failure(r, "nowhere.json", "does not exist")
    assert "merged" not in r.stdout and not db.exists()


def test_import_is_refused_whole_for_one_bad_record(tmp_path):
    db = tmp_path / "db.json"
    src = tmp_path / "in.json"
    entries = {"norm_act.fwd|a#rows=1": {"config": GOOD, "time_ms": 0.5},
               "norm_act.fwd|b#rows=1": {"config": GOOD, "time_ms": 1e12},
               "norm_act.fwd|c#rows=1": {"config": GOOD + ",bogus=3", "time_ms": 0.5},
               "nosuch.op|d#rows=1": {"config": "a=1", "time_ms": 0.5}}
    src.write_text(json.dumps(_doc(entries)))
    r = cli("tune", "--import", str(src), env={"KSPEC_TUNING_DB": str(db)})
    assert_clean_failure(r, "3 of 4 records", "nothing was merged", "time_ms", "'bogus'", "'nosuch.op'")
    assert not db.exists()


def test_import_over_the_size_limit_is_refused(tmp_path):
    db = tmp_path / "db.json"
    src = tmp_path / "big.json"
    src.write_text(json.dumps(_doc({})))
    os.truncate(src, (16 << 20) + 1)  # sparse
    assert_clean_failure(cli("tune", "--import", str(src), env={"KSPEC_TUNING_DB": str(db)}), "16 MiB")
    assert not db.exists()
