"""pytest setup: a private kernel cache per session, the gpu marker (skipped without a CUDA GPU), and
the recorder fixture of the optimizer tests; shared helpers (tolerances by dtype, relative error) are in helpers.py."""
import os
import tempfile

import pytest

_cache = tempfile.mkdtemp(prefix="kspec-pytest-")
os.environ.setdefault("KSPEC_CACHE_DIR", os.path.join(_cache, "cache"))


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (or no torch)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class Recorder:
    """kspec.optim's native BoundCall stand-in: records each bind (Recorder.binds) and its runs' params."""

    binds = []

    def __init__(self, op, inputs, outputs, params):
        assert op == "adamw"
        self.inputs, self.outputs, self.params = inputs, outputs, params
        self.runs = []
        Recorder.binds.append(self)

    def run(self, params, outputs, stream):
        self.runs.append(dict(params))

    def idle(self):
        return True


@pytest.fixture
def recorder(monkeypatch):
    """kspec.optim binds and runs Recorders instead of kernels (test_optim_cache.py, test_dropin_optim.py)."""
    import kspec.optim

    Recorder.binds = []
    monkeypatch.setattr(kspec.optim, "_C", type("C", (), {"BoundCall": Recorder}))
    monkeypatch.setattr(kspec.optim, "current_stream", lambda *a: 0)
    return Recorder
