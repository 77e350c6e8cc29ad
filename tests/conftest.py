"""Shared pytest set-up: GPU tests skip without CUDA; tests run single-threaded torch for determinism."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # the marker, not the keyword: every test under tests/gpu has the keyword "gpu" (its folder's name)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
