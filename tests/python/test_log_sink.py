"""Issue 31, logging: the C++ core's diagnostics reach Python — warnings as kspec.KspecWarning through
`warnings` (so filters and pytest.warns see them, and nothing is written past Python to stderr), every
message to the `kspec` logger once logging is configured — also from compile threads that released the
GIL, without deadlock. Each case runs in a fresh process: a warning is given once per process."""
import os
import subprocess
import sys
import textwrap

import kspec

# A cache directory below a regular file cannot be created, even by root: the first compile warns that
# the disk cache cannot be written (once) and keeps the kernel in memory.
PRELUDE = textwrap.dedent("""
    import logging, os, sys, threading, warnings
    import kspec
""")


def run(tmp_path, body, **env):
    (tmp_path / "file").write_text("x")
    e = dict(os.environ, KSPEC_CACHE_DIR=str(tmp_path / "file" / "cache"), KSPEC_TUNE="off", **env)
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                       env=e, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_warning_is_a_python_warning_not_raw_stderr(tmp_path):
    r = run(tmp_path, """
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            kspec.compile("norm_act.fwd", dtype="f32", hidden=64)
        got = [str(x.message) for x in w if issubclass(x.category, kspec.KspecWarning)]
        assert len(got) == 1 and "cannot be written" in got[0], [str(x.message) for x in w]
        warnings.simplefilter("error", kspec.KspecWarning)  # filters apply: nothing else escapes
    """)
    assert "[kspec]" not in r.stderr and "cannot be written" not in r.stderr, r.stderr


def test_warnings_can_be_silenced(tmp_path):
    r = run(tmp_path, """
        warnings.filterwarnings("ignore", category=kspec.KspecWarning)
        kspec.compile("norm_act.fwd", dtype="f32", hidden=64)
    """)
    assert "cannot be written" not in r.stderr, r.stderr


def test_logging_gets_info_and_warnings_from_compile_threads(tmp_path):
    """KSPEC_VERBOSE=1: one info line per compilation; four threads compile at once (the GIL released
    in the C++ compile), each line is taken back to Python under the GIL: all arrive, nothing hangs."""
    r = run(tmp_path, """
        records = []
        class Keep(logging.Handler):
            def emit(self, rec):
                records.append((rec.levelname, rec.getMessage(), rec.name))
        logging.getLogger("kspec").addHandler(Keep())
        logging.getLogger("kspec").setLevel(logging.INFO)
        warnings.simplefilter("ignore", kspec.KspecWarning)
        ts = [threading.Thread(target=kspec.compile, args=("norm_act.fwd",), kwargs=dict(dtype="f32", hidden=h))
              for h in (64, 96, 128, 160)]
        for t in ts: t.start()
        for t in ts: t.join(timeout=300)
        assert not any(t.is_alive() for t in ts), "a compile thread is stuck"
        infos = [m for lv, m, n in records if lv == "INFO" and m.startswith("compiling ")]
        warns = [m for lv, m, n in records if lv == "WARNING"]
        assert len(infos) == 4, records
        assert len(warns) == 1 and "cannot be written" in warns[0], records
        assert {n for _, _, n in records} == {"kspec"}
    """, KSPEC_VERBOSE="1")
    assert "[kspec]" not in r.stderr, r.stderr


def test_verbose_without_logging_still_prints_info(tmp_path):
    r = run(tmp_path, """
        warnings.simplefilter("ignore", kspec.KspecWarning)
        kspec.compile("norm_act.fwd", dtype="f32", hidden=64)
    """, KSPEC_VERBOSE="1")
    assert "[kspec] compiling " in r.stderr, r.stderr


def test_set_log_sink_takes_a_callable_or_none():
    import pytest

    with pytest.raises(kspec.InvalidArgument, match="expected a callable or None, got int"):
        kspec._C.set_log_sink(3)
    kspec._C.set_log_sink(None)  # back to stderr ...
    from kspec import _log

    _log.install(kspec._C)  # ... and Python's sink again for the rest of the session
