"""Fixtures chaining the layers over the pure-Python fake: fake → ctrl → ns → qpair."""

from __future__ import annotations

import os

import pytest
from fake_nvme import FakeBar, FakeNvme, IdentityDma

from nvmedirect.nvme.controller import Controller

IMAGE_BYTES = 4 << 20


@pytest.fixture
def image() -> bytearray:
    return bytearray(os.urandom(IMAGE_BYTES))


@pytest.fixture
def fake(image) -> FakeNvme:
    return FakeNvme(image)


@pytest.fixture
def ctrl(fake):
    controller = Controller(FakeBar(fake), IdentityDma(), io_timeout_s=1.0)
    controller.start(io_queues=4)
    yield controller
    controller.close()
    assert controller.dma.live_mappings() == 0


@pytest.fixture
def ns(ctrl):
    return ctrl.namespace(1)


@pytest.fixture
def qpair(ctrl):
    qp = ctrl.create_io_qpair(depth=16)
    yield qp
    if not qp.closed:
        ctrl.delete_io_qpair(qp)
