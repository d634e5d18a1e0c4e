"""The status table, the retry rule and the named exceptions."""

import pytest

from nvmedirect import errors
from nvmedirect.spec.status import HOST_TIMEOUT, NvmeStatus


def cqe_status(sct, sc, dnr=False, phase=1):
    return sct << 9 | sc << 1 | int(dnr) << 15 | phase


def test_decode_ignores_the_phase_tag():
    assert NvmeStatus.from_cqe_status(1).ok
    assert NvmeStatus.from_cqe_status(0).ok


@pytest.mark.parametrize("sct,sc,name,cls", [
    (0, 0x80, "LBA Out of Range", errors.LbaOutOfRange),
    (0, 0x02, "Invalid Field in Command", errors.InvalidField),
    (0, 0x01, "Invalid Command Opcode", errors.InvalidOpcode),
    (1, 0x01, "Invalid Queue Identifier", errors.CommandSpecificError),
    (2, 0x81, "Unrecovered Read Error", errors.UnrecoveredReadError),
    (2, 0x85, "Compare Failure", errors.MediaError),
    (0, 0x7F, "Unknown Status", errors.GenericStatusError),
])
def test_named_statuses(sct, sc, name, cls):
    status = NvmeStatus.from_cqe_status(cqe_status(sct, sc, dnr=True))
    assert status.name == name and status.dnr
    exc = status.exception(opcode="read", cid=7)
    assert type(exc) is cls
    assert str(exc) == f"ERROR status: {sct:02x}/{sc:02x} {name} DNR (read, cid 7)"


def test_retry_honours_dnr():
    assert NvmeStatus.from_cqe_status(cqe_status(0, 0x06)).is_retryable()
    assert not NvmeStatus.from_cqe_status(cqe_status(0, 0x06, dnr=True)).is_retryable()
    assert not NvmeStatus.from_cqe_status(cqe_status(0, 0x00)).is_retryable()


def test_host_timeout_is_a_status_too():
    assert HOST_TIMEOUT.name == "Command Timeout"
    assert isinstance(HOST_TIMEOUT.exception(), errors.CommandTimeout)
    assert not HOST_TIMEOUT.is_retryable()
