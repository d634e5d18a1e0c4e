"""Layouts and encodings straight from the NVMe base specification."""

import numpy as np

from nvmedirect.nvme.identify import ControllerInfo, NamespaceInfo
from nvmedirect.spec import layout
from nvmedirect.vfio._ffi import ffi


def test_entry_sizes_and_offsets_match_the_spec():
    assert ffi.sizeof("struct nvd_sqe") == 64
    assert ffi.sizeof("struct nvd_cqe") == 16
    assert ffi.offsetof("struct nvd_sqe", "prp1") == 24
    assert ffi.offsetof("struct nvd_sqe", "cdw10") == 40
    assert ffi.offsetof("struct nvd_cqe", "status") == 14


def test_cap_bits_decode():
    # MQES 2047, CQR, TO 15 (7.5 s), DSTRD 2, CSS NVM, MPSMIN 0, MPSMAX 4
    raw = 2047 | 1 << 16 | 15 << 24 | 2 << 32 | 1 << 37 | 4 << 52
    cap = layout.cap(raw)
    assert (cap.bits.mqes, cap.bits.cqr, cap.bits.to, cap.bits.dstrd, cap.bits.css, cap.bits.mpsmax) == (
        2047, 1, 15, 2, 1, 4)


def test_cc_encoding_for_enable():
    cc = layout.cc()
    cc.bits.en, cc.bits.iosqes, cc.bits.iocqes = 1, 6, 4
    assert cc.raw == 0x00460001


def test_csts_and_aqa():
    csts = layout.csts(0b1011)
    assert (csts.bits.rdy, csts.bits.cfs, csts.bits.shst) == (1, 1, 2)
    aqa = layout.aqa()
    aqa.bits.asqs, aqa.bits.acqs = 31, 63
    assert aqa.raw == 63 << 16 | 31


def test_doorbell_offsets_honour_the_stride():
    assert layout.sq_doorbell_offset(0, 0) == 0x1000
    assert layout.cq_doorbell_offset(0, 0) == 0x1004
    assert layout.sq_doorbell_offset(3, 0) == 0x1018
    assert layout.cq_doorbell_offset(1, 2) == 0x1000 + 3 * 16


def test_identify_controller_parse():
    page = np.zeros(1, dtype=layout.IDENTIFY_CONTROLLER)
    page["sn"], page["mn"], page["fr"], page["mdts"], page["nn"] = b"SN123   ", b"QEMU NVMe Ctrl  ", b"8.2", 7, 2
    info = ControllerInfo.parse(page.tobytes())
    assert (info.serial, info.model, info.firmware, info.mdts, info.namespace_count) == (
        "SN123", "QEMU NVMe Ctrl", "8.2", 7, 2)
    assert info.max_transfer_bytes() == 512 << 10
    page["mdts"] = 0
    assert ControllerInfo.parse(page.tobytes()).max_transfer_bytes() is None


def test_identify_namespace_with_4096_byte_lbas():
    page = np.zeros(1, dtype=layout.IDENTIFY_NAMESPACE)
    page["nsze"], page["nlbaf"], page["flbas"] = 1000, 1, 1
    page["lbaf"][0][0]["lbads"], page["lbaf"][0][1]["lbads"] = 9, 12
    info = NamespaceInfo.parse(1, page.tobytes())
    assert info.lba_size == 4096 and info.size_bytes == 4096000
    assert [f.data_size for f in info.formats] == [512, 4096] and info.formats[1].in_use
