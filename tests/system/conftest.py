from __future__ import annotations

import pytest
from system_fakes import FakeSystem


@pytest.fixture
def fake(tmp_path) -> FakeSystem:
    return FakeSystem(tmp_path / "root")
