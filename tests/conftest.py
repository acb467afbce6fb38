"""Shared pytest fixtures. Plain helpers (model directories, fixed inputs) live in tests/helpers.py
so that torchrun worker scripts can import them too; the model-directory helper is re-exported here."""
from __future__ import annotations

import pytest

from helpers import make_hf_model_dir  # noqa: F401  (re-export)


# ---------------------------------------------------------------------- distributed / Megatron state

@pytest.fixture(scope="session")
def dist_cpu():
    """The cpu Backend with the default process group initialised once per session (a single-process
    gloo group; Megatron-core needs one). Multi-process tests run torchrun in a subprocess instead."""
    from periodic_async.backend import get_backend
    backend = get_backend("cpu")
    backend.init_distributed()
    return backend


@pytest.fixture
def megatron_tp1(dist_cpu):
    """Megatron parallel state reset to TP=1, PP=1 (seed 0) for this test; returns the Backend."""
    dist_cpu.init_model_parallel(1, 1, seed=0)
    return dist_cpu
