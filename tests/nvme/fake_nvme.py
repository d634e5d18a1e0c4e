"""A pure-Python NVMe controller for unit tests: registers, doorbells, admin and NVM commands
executed synchronously against a bytearray image, completions posted with phase tags.

DMA addresses are host virtual addresses (`IdentityDma`), so the fake reads SQEs and PRP lists and
moves data with plain memory access. It checks what a real controller would reject (misaligned
PRPs, LBA ranges, transfer sizes, queue ids) so the driver's encoding is tested, not just echoed.
It is a unit-test aid only: the VM tests drive QEMU's NVMe controller.
"""

from __future__ import annotations

import numpy as np

from nvmedirect.spec.layout import IDENTIFY_CONTROLLER, IDENTIFY_NAMESPACE, Reg
from nvmedirect.vfio._ffi import ffi
from nvmedirect.vfio.dma import DmaAllocator, _Allocation
from nvmedirect.vfio.memory import PAGE_SIZE

GENERIC, SPECIFIC = 0, 1
DNR = 0x100


class IdentityDma(DmaAllocator):
    """Device address == host virtual address (only meaningful for the in-process fake)."""

    def _map(self, mem):
        pages = mem.address + PAGE_SIZE * np.arange(mem.nbytes // PAGE_SIZE, dtype=np.uint64)
        return _Allocation(self, mem, pages, None, physical=False)

    def _unmap(self, allocation):
        pass


def host_bytes(address: int, nbytes: int):
    return ffi.buffer(ffi.cast("char *", address), nbytes)


class FakeDoorbell:
    def __init__(self, ctrl: FakeNvme, offset: int):
        self.ctrl = ctrl
        self.offset = offset

    def ring(self, value: int) -> None:
        self.ctrl.doorbell_written(self.offset, value)


class FakeBar:
    def __init__(self, ctrl: FakeNvme):
        self.ctrl = ctrl

    def read32(self, offset: int) -> int:
        return self.ctrl.read_register(offset) & 0xFFFFFFFF

    def read64(self, offset: int) -> int:
        return self.ctrl.read_register(offset)

    def write32(self, offset: int, value: int) -> None:
        self.ctrl.write_register(offset, value)

    def write64(self, offset: int, value: int) -> None:
        self.ctrl.write_register(offset, value)

    def doorbell(self, offset: int) -> FakeDoorbell:
        return FakeDoorbell(self.ctrl, offset)


class FakeNvme:
    def __init__(self, image: bytearray, lba_size: int = 512, mdts: int = 5, mqes: int = 255, dstrd: int = 0,
                 max_io_queues: int = 4, serial: str = "FAKE0001", model: str = "nvmedirect fake"):
        self.image = image
        self.lba_size = lba_size
        self.mdts = mdts
        self.mqes = mqes
        self.dstrd = dstrd
        self.max_io_queues = max_io_queues
        self.serial, self.model = serial, model
        self.regs = {Reg.CC: 0, Reg.CSTS: 0, Reg.AQA: 0, Reg.ASQ: 0, Reg.ACQ: 0}
        self.sqs: dict[int, dict] = {}
        self.cqs: dict[int, dict] = {}
        self.doorbell_writes = {"sq": 0, "cq": 0}
        self.hold = False  # keep submitted commands until release()
        self.held: list[tuple[int, int]] = []
        self.ignore_opcodes: set[int] = set()  # I/O opcodes never completed (timeouts)
        self.commands_seen: list[tuple[int, int, int]] = []  # (qid, opcode, nlb)
        self.removed = False
        self.bad_lbas: set[int] = set()  # reads touching these complete with Unrecovered Read Error

    # -- registers -----------------------------------------------------------------------------
    def read_register(self, offset: int) -> int:
        if self.removed:
            return 0xFFFFFFFFFFFFFFFF
        if offset == Reg.CAP:
            return self.mqes | 1 << 16 | 4 << 24 | self.dstrd << 32 | 1 << 37
        if offset == Reg.VS:
            return 0x10400
        return self.regs.get(offset, 0)

    def write_register(self, offset: int, value: int) -> None:
        if offset != Reg.CC:
            self.regs[offset] = value
            return
        was_enabled = self.regs[Reg.CC] & 1
        self.regs[Reg.CC] = value
        if (value >> 14) & 3:  # shutdown requested
            self.regs[Reg.CSTS] = (self.regs[Reg.CSTS] & ~0xC) | 2 << 2
        if value & 1 and not was_enabled:
            depth_sq, depth_cq = (self.regs[Reg.AQA] & 0xFFF) + 1, ((self.regs[Reg.AQA] >> 16) & 0xFFF) + 1
            assert (value >> 16) & 0xF == 6 and (value >> 20) & 0xF == 4, "IOSQES/IOCQES must be 6/4"
            self.cqs = {0: {"base": self.regs[Reg.ACQ], "size": depth_cq, "tail": 0, "phase": 1, "head": 0}}
            self.sqs = {0: {"base": self.regs[Reg.ASQ], "size": depth_sq, "cqid": 0, "head": 0, "tail": 0}}
            self.regs[Reg.CSTS] = 1
        elif not value & 1 and was_enabled:
            self.sqs, self.cqs, self.held = {}, {}, []
            self.regs[Reg.CSTS] = 0  # also clears CFS, as a controller reset does

    def set_fatal(self) -> None:
        self.regs[Reg.CSTS] |= 2

    # -- doorbells -----------------------------------------------------------------------------
    def doorbell_written(self, offset: int, value: int) -> None:
        index = (offset - Reg.DOORBELL_BASE) // (4 << self.dstrd)
        qid, is_cq = divmod(index, 2)
        if is_cq:
            self.doorbell_writes["cq"] += 1
            self.cqs[qid]["head"] = value
            return
        self.doorbell_writes["sq"] += 1
        sq = self.sqs[qid]
        assert value < sq["size"], f"SQ {qid} tail {value} beyond size {sq['size']}"
        sq["tail"] = value
        while sq["head"] != sq["tail"]:
            slot = sq["head"]
            sq["head"] = (sq["head"] + 1) % sq["size"]
            if self.hold:
                self.held.append((qid, slot))
            else:
                self._run(qid, slot)

    def release(self, count: int | None = None) -> None:
        batch, self.held = self.held[:count], self.held[count:] if count is not None else []
        for qid, slot in batch:
            self._run(qid, slot)

    def _run(self, qid: int, slot: int) -> None:
        sq = self.sqs[qid]
        sqe = ffi.cast("struct nvd_sqe *", sq["base"])[slot]
        if qid and sqe.opcode in self.ignore_opcodes:
            return
        sct, sc, dw0 = self._admin(sqe) if qid == 0 else self._io(sqe)
        self._post(sq["cqid"], sqe.cid, qid, sq["head"], sct, sc, dw0)

    def _post(self, cqid: int, cid: int, sqid: int, sq_head: int, sct: int, sc: int, dw0: int) -> None:
        cq = self.cqs[cqid]
        assert (cq["tail"] + 1) % cq["size"] != cq["head"], "completion queue overflow"
        entry = ffi.cast("struct nvd_cqe *", cq["base"])[cq["tail"]]
        entry.dw0, entry.dw1, entry.sq_head, entry.sq_id, entry.cid = dw0, 0, sq_head, sqid, cid
        # `sc` values above 0xFF carry Do Not Retry in bit 8 (DNR below).
        entry.status = (sct << 9) | ((sc & 0xFF) << 1) | ((sc >> 8) << 15) | cq["phase"]
        cq["tail"] += 1
        if cq["tail"] == cq["size"]:
            cq["tail"], cq["phase"] = 0, cq["phase"] ^ 1

    # -- data movement -------------------------------------------------------------------------
    def prp_segments(self, prp1: int, prp2: int, length: int) -> list[tuple[int, int]]:
        assert prp1 % 4 == 0, "PRP1 must be dword aligned"
        first = min(length, PAGE_SIZE - prp1 % PAGE_SIZE)
        segments = [(prp1, first)]
        remaining = length - first
        if remaining == 0:
            return segments
        if remaining <= PAGE_SIZE:
            assert prp2 % PAGE_SIZE == 0, "PRP2 data pointer must be page aligned"
            return segments + [(prp2, remaining)]
        assert prp2 % 8 == 0, "PRP list pointer must be qword aligned"
        entries = np.frombuffer(host_bytes(prp2 - prp2 % PAGE_SIZE, PAGE_SIZE), dtype="<u8")
        index = (prp2 % PAGE_SIZE) // 8
        while remaining:
            if index == 511 and remaining > PAGE_SIZE:  # last entry of a full list: chain pointer
                pointer = int(entries[index])
                assert pointer % PAGE_SIZE == 0, "chained PRP list must be page aligned"
                entries = np.frombuffer(host_bytes(pointer, PAGE_SIZE), dtype="<u8")
                index = 0
                continue
            page = int(entries[index])
            assert page % PAGE_SIZE == 0, f"PRP list entry {page:#x} not page aligned"
            take = min(PAGE_SIZE, remaining)
            segments.append((page, take))
            remaining -= take
            index += 1
        return segments

    def _copy_out(self, sqe, data: bytes) -> None:
        at = 0
        for address, length in self.prp_segments(sqe.prp1, sqe.prp2, len(data)):
            host_bytes(address, length)[:] = data[at:at + length]
            at += length

    def _copy_in(self, sqe, length: int) -> bytes:
        return b"".join(bytes(host_bytes(a, n)) for a, n in self.prp_segments(sqe.prp1, sqe.prp2, length))

    # -- commands ------------------------------------------------------------------------------
    def _admin(self, sqe):
        op = sqe.opcode
        if op == 0x06:  # identify
            page = np.zeros(1, dtype=IDENTIFY_CONTROLLER if sqe.cdw10 == 1 else IDENTIFY_NAMESPACE)
            if sqe.cdw10 == 1:
                page["sn"], page["mn"], page["fr"] = self.serial.ljust(20), self.model.ljust(40), b"1.0     "
                page["mdts"], page["nn"], page["sqes"], page["cqes"] = self.mdts, 1, 0x66, 0x44
            elif sqe.cdw10 == 0:
                if sqe.nsid != 1:
                    return GENERIC, 0x0B, 0
                page["nsze"] = page["ncap"] = page["nuse"] = len(self.image) // self.lba_size
                page["nlbaf"], page["flbas"] = 1, 1 if self.lba_size == 4096 else 0
                page["lbaf"][0][0]["lbads"], page["lbaf"][0][1]["lbads"] = 9, 12
            elif sqe.cdw10 == 2:
                raw = np.zeros(1024, dtype="<u4")
                raw[0] = 1
                self._copy_out(sqe, raw.tobytes())
                return GENERIC, 0, 0
            else:
                return GENERIC, 0x02, 0
            self._copy_out(sqe, page.tobytes())
            return GENERIC, 0, 0
        if op == 0x09 and sqe.cdw10 == 0x07:  # number of queues
            n = min(self.max_io_queues, (sqe.cdw11 & 0xFFFF) + 1) - 1
            return GENERIC, 0, n | n << 16
        qid, size = sqe.cdw10 & 0xFFFF, (sqe.cdw10 >> 16) + 1
        if op in (0x05, 0x01):  # create CQ / SQ
            if not 1 <= qid <= self.max_io_queues or size > self.mqes + 1:
                return SPECIFIC, 0x01 if size <= self.mqes + 1 else 0x02, 0
            if op == 0x05:
                self.cqs[qid] = {"base": sqe.prp1, "size": size, "tail": 0, "phase": 1, "head": 0}
            else:
                if (sqe.cdw11 >> 16) not in self.cqs:
                    return SPECIFIC, 0x00, 0
                self.sqs[qid] = {"base": sqe.prp1, "size": size, "cqid": sqe.cdw11 >> 16, "head": 0, "tail": 0}
            return GENERIC, 0, 0
        if op in (0x00, 0x04):  # delete SQ / CQ
            table = self.sqs if op == 0x00 else self.cqs
            if qid not in table:
                return SPECIFIC, 0x01, 0
            del table[qid]
            return GENERIC, 0, 0
        return GENERIC, 0x01, 0

    def _io(self, sqe):
        if sqe.opcode == 0x00:
            return GENERIC, 0, 0
        lba = sqe.cdw10 | sqe.cdw11 << 32
        nlb = (sqe.cdw12 & 0xFFFF) + 1
        self.commands_seen.append((0, sqe.opcode, nlb))
        if sqe.nsid != 1:
            return GENERIC, 0x0B, 0
        if (lba + nlb) * self.lba_size > len(self.image):
            return GENERIC, DNR | 0x80, 0  # LBA Out of Range, as QEMU reports it
        if self.mdts and nlb * self.lba_size > PAGE_SIZE << self.mdts:
            return GENERIC, 0x02, 0
        start, length = lba * self.lba_size, nlb * self.lba_size
        if sqe.opcode == 0x02 and self.bad_lbas.intersection(range(lba, lba + nlb)):
            return 0x2, DNR | 0x81, 0  # media error: Unrecovered Read Error, as a failing drive reports it
        if sqe.opcode == 0x02:
            self._copy_out(sqe, bytes(self.image[start:start + length]))
        elif sqe.opcode == 0x01:
            self.image[start:start + length] = self._copy_in(sqe, length)
        else:
            return GENERIC, 0x01, 0
        return GENERIC, 0, 0
