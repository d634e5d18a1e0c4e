"""Identify Controller / Namespace pages decoded into plain dataclasses."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from nvmedirect.host_memory import PAGE_SIZE
from nvmedirect.spec.layout import IDENTIFY_CONTROLLER, IDENTIFY_NAMESPACE


def _text(raw: bytes) -> str:
    return raw.decode("ascii", errors="replace").rstrip(" \0")


@dataclass
class ControllerInfo:
    vid: int
    ssvid: int
    serial: str
    model: str
    firmware: str
    mdts: int  # 0: no limit; else the limit is 2^mdts memory pages
    cntlid: int
    version: int
    namespace_count: int
    sqes: int
    cqes: int
    oncs: int
    volatile_write_cache: bool

    @classmethod
    def parse(cls, page: bytes | np.ndarray) -> ControllerInfo:
        rec = np.frombuffer(bytes(page[:PAGE_SIZE]), dtype=IDENTIFY_CONTROLLER)[0]
        return cls(vid=int(rec["vid"]), ssvid=int(rec["ssvid"]), serial=_text(rec["sn"]),
                   model=_text(rec["mn"]), firmware=_text(rec["fr"]), mdts=int(rec["mdts"]),
                   cntlid=int(rec["cntlid"]), version=int(rec["ver"]), namespace_count=int(rec["nn"]),
                   sqes=int(rec["sqes"]), cqes=int(rec["cqes"]), oncs=int(rec["oncs"]),
                   volatile_write_cache=bool(rec["vwc"] & 1))

    def max_transfer_bytes(self, min_page_size: int = PAGE_SIZE) -> int | None:
        """Largest single transfer the controller accepts, or None when it sets no limit."""
        return None if self.mdts == 0 else min_page_size << self.mdts

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LbaFormat:
    index: int
    data_size: int
    metadata_size: int
    relative_performance: int
    in_use: bool


@dataclass
class NamespaceInfo:
    nsid: int
    size_blocks: int  # NSZE
    capacity_blocks: int
    utilization_blocks: int
    lba_size: int
    metadata_size: int
    formats: list[LbaFormat] = field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        return self.size_blocks * self.lba_size

    @classmethod
    def parse(cls, nsid: int, page: bytes | np.ndarray) -> NamespaceInfo:
        rec = np.frombuffer(bytes(page[:PAGE_SIZE]), dtype=IDENTIFY_NAMESPACE)[0]
        current = int(rec["flbas"]) & 0xF
        formats = []
        for index in range(int(rec["nlbaf"]) + 1):
            lbaf = rec["lbaf"][index]
            formats.append(LbaFormat(index, 1 << int(lbaf["lbads"]), int(lbaf["ms"]), int(lbaf["rp"]) & 3,
                                     index == current))
        in_use = formats[current] if current < len(formats) else None
        if in_use is None or in_use.data_size < 512:
            raise ValueError(f"namespace {nsid} reports no usable LBA format (FLBAS {current})")
        return cls(nsid=nsid, size_blocks=int(rec["nsze"]), capacity_blocks=int(rec["ncap"]),
                   utilization_blocks=int(rec["nuse"]), lba_size=in_use.data_size,
                   metadata_size=in_use.metadata_size, formats=formats)

    def to_dict(self) -> dict:
        return asdict(self) | {"size_bytes": self.size_bytes}
