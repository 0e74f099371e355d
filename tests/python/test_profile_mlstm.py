"""tools/gpu/profile_mlstm.py --compare's step table, without a GPU: the configs it times beside the
default are valid for mlstm.step at its shapes (an invalid one would only fail on the GPU machine), and
the shared timer it imports (tools/bench/timing.py: gpu time with a spin queued before the start event,
apart from the host's enqueue time) is where the script looks for it."""
import importlib.util
import os

import pytest

pytest.importorskip("torch")
import kspec  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "gpu", "profile_mlstm.py")


def _script():
    spec = importlib.util.spec_from_file_location("profile_mlstm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_step_configs_are_valid_at_the_timed_shapes():
    mod = _script()
    named = [c for c in mod.STEP_CONFIGS if c is not None]
    assert mod.STEP_CONFIGS[0] is None and {c.split(",")[0] for c in named} == {"algo=split", "algo=block"}
    for case in ("B_1_dh_128", "model_B64_NH8_dh128"):  # NH = 8, DH = 128 at B = 1 and 64
        valid = set(kspec._C.configs_for_case("mlstm.step", case, "bf16"))
        for c in named:
            assert c in valid, (case, c)


def test_step_timer_is_found_where_the_script_looks():
    timing = os.path.join(os.path.dirname(os.path.abspath(SCRIPT)), "..", "bench", "timing.py")
    with open(timing) as fh:
        text = fh.read()
    assert "class GpuTimer" in text and "_sleep" in text
