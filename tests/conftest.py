"""Shared fixtures. GPU tests carry the `gpu` marker and skip cleanly without a usable GPU."""
from __future__ import annotations

import pytest

from omnicupy import arrays


def pytest_collection_modifyitems(config, items):
    if arrays.gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none usable here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """An empty kernel cache for one test."""
    monkeypatch.setenv("OMNICUPY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
