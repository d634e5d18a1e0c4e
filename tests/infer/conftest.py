"""Fixtures of tests/infer: a random generator whose seed is printed (the native CPU kernel tests),
and the kernel implementation (AVX2 or portable) put back after any test that forces one."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from infer import cpu_kernels


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _restore_implementation() -> Iterator[None]:
    if not cpu_kernels.available():
        yield
        return
    before = cpu_kernels.implementation()
    yield
    cpu_kernels.set_implementation(before)
