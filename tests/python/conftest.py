"""pytest setup: a private kernel cache per session, the gpu marker (skipped without a CUDA GPU), and
shared helpers (tolerances by dtype, relative error)."""
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
