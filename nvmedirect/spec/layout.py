"""NVMe structures and constants (base spec 1.4): registers, opcodes, queue entries, Identify.

Queue entries and registers are cffi structs/unions compiled from native/nvme_queue.cdef, so the
C hot path and Python share one layout; Identify pages are numpy structured dtypes. Sizes and
offsets are checked at import: a wrong layout fails loudly before any device is touched.
"""

from __future__ import annotations

import numpy as np

from nvmedirect.vfio._ffi import ffi

SQE_SIZE = 64
CQE_SIZE = 16
ADMIN_QID = 0


class Reg:
    """Controller register offsets in BAR0."""

    CAP = 0x00
    VS = 0x08
    INTMS = 0x0C
    INTMC = 0x10
    CC = 0x14
    CSTS = 0x1C
    NSSR = 0x20
    AQA = 0x24
    ASQ = 0x28
    ACQ = 0x30
    DOORBELL_BASE = 0x1000


def sq_doorbell_offset(qid: int, dstrd: int) -> int:
    """Offset of submission queue `qid`'s tail doorbell; CAP.DSTRD spaces doorbells 4<<DSTRD apart."""
    return Reg.DOORBELL_BASE + (2 * qid) * (4 << dstrd)


def cq_doorbell_offset(qid: int, dstrd: int) -> int:
    return Reg.DOORBELL_BASE + (2 * qid + 1) * (4 << dstrd)


class AdminOpcode:
    DELETE_IO_SQ = 0x00
    CREATE_IO_SQ = 0x01
    GET_LOG_PAGE = 0x02
    DELETE_IO_CQ = 0x04
    CREATE_IO_CQ = 0x05
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A


class IoOpcode:
    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02


class Cns:
    """Identify's Controller or Namespace Structure selector (CDW10)."""

    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NAMESPACES = 0x02


class FeatureId:
    NUMBER_OF_QUEUES = 0x07


OPCODE_NAMES_ADMIN = {v: k.lower() for k, v in vars(AdminOpcode).items() if not k.startswith("_")}
OPCODE_NAMES_IO = {v: k.lower() for k, v in vars(IoOpcode).items() if not k.startswith("_")}


def opcode_name(opcode: int, admin: bool) -> str:
    names = OPCODE_NAMES_ADMIN if admin else OPCODE_NAMES_IO
    return names.get(opcode, f"opcode {opcode:#04x}")


# -- registers as cffi raw/bits unions ----------------------------------------------------------
def decode_register(union_name: str, raw: int):
    """Return a cffi union (`.raw`, `.bits.<field>`) holding `raw`."""
    reg = ffi.new(f"union {union_name} *")
    reg.raw = raw
    return reg


def cap(raw: int):
    return decode_register("nvd_reg_cap", raw)


def cc(raw: int = 0):
    return decode_register("nvd_reg_cc", raw)


def csts(raw: int):
    return decode_register("nvd_reg_csts", raw)


def aqa(raw: int = 0):
    return decode_register("nvd_reg_aqa", raw)


def version_string(vs: int) -> str:
    return f"{vs >> 16}.{(vs >> 8) & 0xFF}.{vs & 0xFF}"


# -- layout checks (the C side has the same as _Static_assert) ----------------------------------
_EXPECTED_OFFSETS = {
    "struct nvd_sqe": {"opcode": 0, "flags": 1, "cid": 2, "nsid": 4, "mptr": 16, "prp1": 24,
                       "prp2": 32, "cdw10": 40, "cdw11": 44, "cdw12": 48, "cdw15": 60},
    "struct nvd_cqe": {"dw0": 0, "dw1": 4, "sq_head": 8, "sq_id": 10, "cid": 12, "status": 14},
}
_EXPECTED_SIZES = {"struct nvd_sqe": SQE_SIZE, "struct nvd_cqe": CQE_SIZE, "union nvd_reg_cap": 8,
                   "union nvd_reg_cc": 4, "union nvd_reg_csts": 4, "union nvd_reg_aqa": 4}


def _check_layouts() -> None:
    for ctype, size in _EXPECTED_SIZES.items():
        if ffi.sizeof(ctype) != size:
            raise ImportError(f"{ctype} is {ffi.sizeof(ctype)} bytes, the NVMe spec says {size}")
    for ctype, fields in _EXPECTED_OFFSETS.items():
        for field, offset in fields.items():
            if ffi.offsetof(ctype, field) != offset:
                raise ImportError(f"{ctype}.{field} is at {ffi.offsetof(ctype, field)}, expected {offset}")


_check_layouts()

# -- Identify structures (4096 bytes each) as numpy dtypes ---------------------------------------
IDENTIFY_CONTROLLER = np.dtype({
    "names": ["vid", "ssvid", "sn", "mn", "fr", "rab", "ieee", "cmic", "mdts", "cntlid", "ver",
              "sqes", "cqes", "maxcmd", "nn", "oncs", "vwc", "subnqn"],
    "formats": ["<u2", "<u2", "S20", "S40", "S8", "u1", "V3", "u1", "u1", "<u2", "<u4",
                "u1", "u1", "<u2", "<u4", "<u2", "u1", "S256"],
    "offsets": [0, 2, 4, 24, 64, 72, 73, 76, 77, 78, 80,
                512, 513, 514, 516, 520, 525, 768],
    "itemsize": 4096,
})

LBA_FORMAT = np.dtype({"names": ["ms", "lbads", "rp"], "formats": ["<u2", "u1", "u1"],
                       "offsets": [0, 2, 3], "itemsize": 4})

IDENTIFY_NAMESPACE = np.dtype({
    "names": ["nsze", "ncap", "nuse", "nsfeat", "nlbaf", "flbas", "mc", "dpc", "dps", "lbaf"],
    "formats": ["<u8", "<u8", "<u8", "u1", "u1", "u1", "u1", "u1", "u1", (LBA_FORMAT, 16)],
    "offsets": [0, 8, 16, 24, 25, 26, 27, 28, 29, 128],
    "itemsize": 4096,
})

for _dtype, _field, _offset in [(IDENTIFY_CONTROLLER, "mdts", 77), (IDENTIFY_CONTROLLER, "nn", 516),
                                (IDENTIFY_CONTROLLER, "subnqn", 768), (IDENTIFY_NAMESPACE, "lbaf", 128),
                                (IDENTIFY_NAMESPACE, "flbas", 26)]:
    if _dtype.fields[_field][1] != _offset:
        raise ImportError(f"Identify field {_field} at {_dtype.fields[_field][1]}, expected {_offset}")
if IDENTIFY_CONTROLLER.itemsize != 4096 or IDENTIFY_NAMESPACE.itemsize != 4096 or LBA_FORMAT.itemsize != 4:
    raise ImportError("Identify structures must be 4096 bytes (LBA format 4)")
