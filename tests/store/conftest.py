"""Fixtures for reader tests: the real SmolLM2 GGUF, fetched and cached by scripts/fetch-models.sh."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def fetch_model(name: str) -> Path:
    out = subprocess.run(["bash", str(REPO / "scripts/fetch-models.sh"), name], check=True,
                         capture_output=True, text=True, timeout=900)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return fetch_model("smollm2")
