"""Hardening of the files kspec keeps (issue 26), through the CLI and the package, without a GPU: JSON nested
too deep or too large, names from an imported file that must not become paths, tuning files planted by
another user, private directories under any umask, a cache cleared by another process, whole-entry
checksums, a read-only cache's maintenance commands, and a bounded storm of verify/prune/precompile
processes that must never remove a healthy entry."""
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

import kspec

DEEP = 140000  # levels: 280 KB that overflowed the stack in the C++ JSON parse


def run(*args, env=None, preexec_fn=None, code=None, prefix=(), timeout=120):
    """`python -m kspec ARGS` (or `python -c CODE`) with extra environment; never raises on failure."""
    e = dict(os.environ)
    e.update({k: str(v) for k, v in (env or {}).items()})
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "kspec", *args]
    return subprocess.run([*prefix, *cmd], capture_output=True, text=True, env=e, preexec_fn=preexec_fn,
                          timeout=timeout)


def assert_clean_failure(r, *needles):
    """Failed with a message, not a crash (signal) or a traceback."""
    out = r.stdout + r.stderr
    assert r.returncode in (1, 2, 5), out  # kspec.cli.EXIT_*: failures found, bad argument, file/cache error
    assert "Traceback" not in out, out
    for n in needles:
        assert n in out, out


def specs(path, hiddens):
    path.write_text("\n".join(json.dumps({"op": "norm_act.fwd", "dtype": "f32", "arch": "sm_90",
                                          "params": {"hidden": h}}) for h in hiddens) + "\n")
    return str(path)


def entry_files(cache):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs if f.endswith((".json", ".bin")))


def deep_db(path):
    path.write_text('{"version": 1, "entries": {"k": {"x": ' + "[" * DEEP + "]" * DEEP + "}}}")
    return str(path)


def test_deep_tuning_database_is_ignored_not_a_crash(tmp_path):
    env = {"KSPEC_TUNING_DB": deep_db(tmp_path / "db.json"), "KSPEC_CACHE_DIR": tmp_path / "c"}
    r = run("tune", "--list", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nested deeper than 64 levels" in r.stderr
    r = run(code="import kspec; print(kspec.explain('norm_act.fwd', dtype='bf16', rows=64, hidden=256).config_source)",
            env=env)
    assert r.returncode == 0 and r.stdout.strip() == "heuristic", r.stdout + r.stderr
    r = run("compile", "norm_act.fwd", "--param", "hidden=64", "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    # A user-given import that deep is refused as not a tuning database, cleanly.
    r = run("tune", "--import", deep_db(tmp_path / "team.json"), env={"KSPEC_CACHE_DIR": tmp_path / "c2"})
    assert_clean_failure(r, "nested deeper than 64 levels")


def test_deep_or_huge_or_malformed_spec_list_is_invalid_argument(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * DEEP + "]" * DEEP)
    assert_clean_failure(run("precompile", "--file", str(deep)), "--file", "not JSON lines or a JSON list")
    huge = tmp_path / "huge.jsonl"
    with open(huge, "wb") as f:
        f.truncate((16 << 20) + 1)
    assert_clean_failure(run("precompile", "--file", str(huge)), "larger than")
    lists = tmp_path / "lists.jsonl"
    lists.write_text("[1, 2]\n")
    assert_clean_failure(run("precompile", "--file", str(lists)), "JSON objects")


def test_import_names_from_data_never_become_paths(tmp_path):
    """`"toolkit": "/../../…/victim"` replaced a file outside the cache; the first command being an import
    under umask 000 created the cache directory 0777."""
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    cache = tmp_path / "c"
    e = kspec.explain("norm_act.fwd", dtype="bf16", rows=64, hidden=256)
    record = {"config": e.config, "time_ms": 0.01, "default_config": e.config, "default_ms": 0.01,
              "op": "norm_act.fwd", "shape": "rows=64,hidden=256", "gpu": "x", "toolkit": "12.8", "updated": "now"}
    team = tmp_path / "team.json"
    team.write_text(json.dumps({"version": 1, "kind": "kspec-tuning", "gpu": "../../../../gpu/..",
                                "toolkit": "/../../../../../../../../../.." + str(victim)[:-len(".json")],
                                "entries": {e.tuning_key: record}}))
    r = run("tune", "--import", str(team), env={"KSPEC_CACHE_DIR": cache}, preexec_fn=lambda: os.umask(0))
    assert victim.read_text() == "precious"
    outside = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
               if not os.path.join(d, f).startswith(str(cache) + os.sep)]
    assert sorted(outside) == sorted([str(victim), str(team)]), outside
    if r.returncode == 0:  # (the record may also be refused by the import's validation)
        written = [f for f in os.listdir(cache / "tuning") if f.endswith(".json")]
        assert len(written) == 1 and written[0].startswith("tuning-"), written
        for d in (cache, cache / "tuning"):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d


@pytest.mark.skipif(os.geteuid() != 0, reason="planting files as another user needs root")
def test_tuning_files_planted_by_another_user_are_refused(tmp_path):
    """In a world-writable KSPEC_CACHE_DIR another user planted tuning/ with a garbage database and a
    .json.corrupt symlink; root's import overwrote the symlink's target."""
    base = tempfile.mkdtemp(dir="/tmp", prefix="kspec-shared-")
    try:
        os.chmod(base, 0o777)
        victim = os.path.join(base, "victim")
        with open(victim, "w") as f:
            f.write("precious")
        tuning = os.path.join(base, "tuning")
        os.mkdir(tuning)
        db = os.path.join(tuning, "tuning-no-gpu-cuda12.8.json")
        with open(db, "w") as f:
            f.write("garbage")
        os.symlink(victim, db + ".corrupt")
        for p in (tuning, db):
            os.lchown(p, 65534, 65534)
        os.lchown(db + ".corrupt", 65534, 65534)
        team = tmp_path / "team.json"
        team.write_text(json.dumps({"version": 1, "gpu": "no-gpu", "toolkit": "12.8", "entries": {}}))
        r = run("tune", "--import", str(team), env={"KSPEC_CACHE_DIR": base})
        assert r.returncode != 0 and r.returncode > 0, r.stdout + r.stderr
        assert "owned by another user" in r.stderr, r.stderr
        with open(victim) as f:
            assert f.read() == "precious"
        assert os.path.islink(db + ".corrupt")
    finally:
        subprocess.run(["rm", "-rf", base])


def test_cache_cleared_by_another_process_is_written_again(tmp_path):
    code = """
import json, os, subprocess, sys, kspec
a = kspec.compile("norm_act.fwd", dtype="f32", hidden=64)[0]
subprocess.run([sys.executable, "-m", "kspec", "cache", "clear"], check=True, capture_output=True)
b = kspec.compile("norm_act.fwd", dtype="f32", hidden=128)[0]
print(json.dumps([a["path"], b["path"], os.path.exists(b["path"] or "/nonexistent")]))
"""
    r = run(code=code, env={"KSPEC_CACHE_DIR": tmp_path / "c"})
    assert r.returncode == 0, r.stdout + r.stderr
    a, b, exists = json.loads(r.stdout.strip().splitlines()[-1])
    assert not os.path.exists(a) and b and exists, r.stdout
    assert "cannot be written" not in r.stderr, r.stderr
    assert stat.S_IMODE(os.stat(tmp_path / "c" / "v1").st_mode) == 0o700


@pytest.mark.parametrize("field", ["lowered_name", "spec", "registers", "spill_bytes", "arch"])
def test_metadata_bit_flip_is_evicted_and_rebuilt_with_one_warning(tmp_path, field):
    env = {"KSPEC_CACHE_DIR": tmp_path / "c"}
    args = ["compile", "norm_act.fwd", "--param", "hidden=64", "--json"]
    first = json.loads(run(*args, env=env).stdout)
    meta_path = first["path"][:-4] + ".json"
    meta = json.load(open(meta_path))
    holder = meta["resources"] if field in ("registers", "spill_bytes") else meta
    v = holder[field]
    holder[field] = v ^ 1 if isinstance(v, int) else v[:-1] + chr(ord(v[-1]) ^ 1)  # one bit, still valid JSON
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    r = run(*args, env=env)
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert again["source"] == "compiled" and again["spill_bytes"] == first["spill_bytes"]
    assert r.stderr.count("metadata checksum mismatch") == 1, r.stderr
    verify = run("cache", "verify", env=env)
    assert verify.returncode == 0 and "0 bad" in verify.stdout, verify.stdout


def test_metadata_bit_flip_is_reported_by_verify(tmp_path):
    env = {"KSPEC_CACHE_DIR": tmp_path / "c"}
    first = json.loads(run("compile", "norm_act.fwd", "--param", "hidden=64", "--json", env=env).stdout)
    meta_path = first["path"][:-4] + ".json"
    text = open(meta_path).read().replace('"spill_bytes": 0', '"spill_bytes": 1')
    open(meta_path, "w").write(text)
    r = run("cache", "verify", env=env)
    assert r.returncode == 1 and "1 bad (1 removed)" in r.stdout and "metadata checksum mismatch" in r.stdout, r.stdout
    assert entry_files(tmp_path / "c") == []


# Permission bits do not bind root: as root, the commands run without the capabilities that bypass them.
READ_ONLY_PREFIX = (["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
                    if os.geteuid() == 0 else [])


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="root without setpriv")
def test_read_only_cache_reports_only_what_it_did(tmp_path):
    cache = str(tmp_path / "c")
    env = {"KSPEC_CACHE_DIR": cache}
    assert run("precompile", "--file", specs(tmp_path / "s.jsonl", [64, 128]), env=env).returncode == 0
    first = sorted(f for f in entry_files(cache) if f.endswith(".json"))[0]
    text = open(first).read()
    open(first, "w").write(text.replace('"arch": "sm_90a"', '"arch": "sm_90b"'))
    before = entry_files(cache)
    assert len(before) == 4
    dirs = [d for d, _, _ in os.walk(cache)]
    for d in dirs:
        os.chmod(d, 0o500)
    try:
        r = run("cache", "stats", env=env, prefix=READ_ONLY_PREFIX)
        assert "read-only" in r.stdout, r.stdout + r.stderr
        r = run("cache", "verify", env=env, prefix=READ_ONLY_PREFIX)
        assert r.returncode == 1 and "1 entries ok, 1 bad (0 removed)" in r.stdout and "not removed" in r.stdout, \
            r.stdout + r.stderr
        assert_clean_failure(run("cache", "prune", "--max-bytes", "0", env=env, prefix=READ_ONLY_PREFIX),
                             "removed 0 entries", "could not remove")
        assert_clean_failure(run("cache", "clear", env=env, prefix=READ_ONLY_PREFIX), "could not remove")
        assert entry_files(cache) == before
    finally:
        for d in dirs:
            os.chmod(d, 0o700)


def test_verify_prune_precompile_storm_never_removes_a_healthy_entry(tmp_path):
    """Bounded: two rounds of 3 verifiers, 2 pruners and 1 precompile (auto-pruning to a small cap) at once."""
    env = {"KSPEC_CACHE_DIR": tmp_path / "c"}
    r = run("precompile", "--file", specs(tmp_path / "a.jsonl", [64, 96, 128, 160, 192, 224]), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    total = json.loads(run("cache", "stats", "--json", env=env).stdout)["bytes"]
    cap = total // 2
    e = dict(os.environ, KSPEC_CACHE_DIR=str(tmp_path / "c"), KSPEC_CACHE_MAX_BYTES=str(cap))
    for rnd in range(2):
        hiddens = [256 + 32 * (4 * rnd + i) for i in range(4)]
        procs = [subprocess.Popen([sys.executable, "-m", "kspec", *a], env=e, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for a in ([["cache", "verify"]] * 3 + [["cache", "prune", "--max-bytes", str(cap)]] * 2
                           + [["precompile", "--file", specs(tmp_path / f"b{rnd}.jsonl", hiddens)]])]
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            assert "Traceback" not in err, err
            if i < 3:
                assert p.returncode == 0 and ", 0 bad" in out, out + err
            else:
                assert p.returncode == 0, out + err
    final = run("cache", "verify", env=env)
    assert final.returncode == 0 and ", 0 bad" in final.stdout, final.stdout
