"""Shared fixtures: the flare package and a fresh, reported random seed per test.

flare must be importable: installed (pip install .) or built with CMake and found through
PYTHONPATH=<build>/python (scripts/python-tests.sh does the latter). Set FLARE_TEST_SEED to
replay a failure; every assertion message carries the seed it ran with.
"""

import os
import random

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_report_header(config):
    import flare
    return (f"flare {flare.__version__} from {os.path.dirname(flare.__file__)}, "
            f"CUDA kernels built: {flare.cuda_built()}")


@pytest.fixture
def seed():
    env = os.environ.get("FLARE_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)
