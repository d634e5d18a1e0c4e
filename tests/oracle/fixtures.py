"""Locating the cached test assets; a missing one skips the test, or fails it when the run requires
oracle tests (NVMEDIRECT_REQUIRE contains "oracle", as scripts/test.sh sets)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.oracle import assets


def require_asset(path: Path) -> Path:
    if path.is_file() and path.stat().st_size > 0:
        return path
    message = f"{path} is missing: run scripts/install-test-deps.sh (scripts/deps/40-models.sh)"
    if "oracle" in os.environ.get("NVMEDIRECT_REQUIRE", ""):
        pytest.fail(message)
    pytest.skip(message)


def model_path(name: str) -> Path:
    """'smollm2-F16', 'smollm2-Q4_1', ..., 'qwen05b', 'qwen15b' or 'gemma3'."""
    if name == "qwen05b":
        return require_asset(assets.qwen05b_path())
    if name == "qwen15b":
        return require_asset(assets.qwen15b_path())
    if name == "gemma3":
        return require_asset(assets.gemma3_path())
    return require_asset(assets.smollm2_path(name.split("-", 1)[1]))


def botchan_text() -> str:
    # as llama.cpp reads a file: every byte, BOM and CRLF included
    return require_asset(assets.botchan_path()).read_bytes().decode("utf-8")
