"""A NumPy rendering of the NVMe read-command rules (native/nvme_sqe.h), written independently of
the C so a mistake shared by the C and CUDA compilations of the header still shows: the SQE bytes
and PRP list entries a correct submitter writes for each command of a workload.

NVMe 1.4: SQE layout (figure 105, NVM Read figure 346), PRPs (section 4.3): PRP1 is the first byte
(dword aligned), PRP2 the second page when the data ends there, else a list of whole pages, 512 per
list page with the last entry of a full page chaining to the next one.
"""

from __future__ import annotations

import numpy as np

from nvmedirect.gpu.rings import Workload
from nvmedirect.host_memory import PAGE_SIZE

SQE_DTYPE = np.dtype([("opcode", "u1"), ("flags", "u1"), ("cid", "<u2"), ("nsid", "<u4"), ("cdw2", "<u4"),
                      ("cdw3", "<u4"), ("mptr", "<u8"), ("prp1", "<u8"), ("prp2", "<u8"), ("cdw10", "<u4"),
                      ("cdw11", "<u4"), ("cdw12", "<u4"), ("cdw13", "<u4"), ("cdw14", "<u4"), ("cdw15", "<u4")])
assert SQE_DTYPE.itemsize == 64, "an NVMe submission queue entry is 64 bytes"
assert SQE_DTYPE.fields["prp1"][1] == 24 and SQE_DTYPE.fields["cdw10"][1] == 40
ENTRIES = PAGE_SIZE // 8
READ = 0x02


def prp_entries(pages: np.ndarray, byte_offset: int, nbytes: int) -> tuple[int, list[int]]:
    """PRP1 and the device addresses of every later page the transfer touches."""
    first, within = divmod(byte_offset, PAGE_SIZE)
    count = -(-(within + nbytes) // PAGE_SIZE)
    return int(pages[first]) + within, [int(p) for p in pages[first + 1:first + count]]


def list_layout(later: list[int], list_iovas: list[int]) -> list[list[int]]:
    """The list pages' contents for the pages after PRP1 (`later`, more than one of them)."""
    layout, rest = [], list(later)
    for k in range(len(list_iovas)):
        if len(rest) <= ENTRIES:
            layout.append(rest)
            return layout
        layout.append(rest[:ENTRIES - 1] + [list_iovas[k + 1] if k + 1 < len(list_iovas) else 0])
        rest = rest[ENTRIES - 1:]
    raise ValueError("transfer needs more PRP list pages than the command owns")


def reference_sqes(work: Workload, first: int, count: int, queue_depth: int, nsid: int, dst_pages: np.ndarray,
                   list_iovas: np.ndarray, list_pages: int) -> tuple[np.ndarray, dict[int, list[list[int]]]]:
    """SQEs of commands first..first+count-1 with CID (i - first) % queue_depth (what
    nvd_host_build writes), and for each command with a list, the list pages' entries by index k."""
    sqes = np.zeros(count, dtype=SQE_DTYPE)
    lists: dict[int, list[list[int]]] = {}
    for k in range(count):
        i = first + k
        cid = k % queue_depth
        nblocks = int(work.nblocks[i])
        prp1, later = prp_entries(dst_pages, int(work.dst_offset[i]), nblocks * work.lba_size)
        if not later:
            prp2 = 0
        elif len(later) == 1:
            prp2 = later[0]
        else:
            own = [int(x) for x in list_iovas[cid * list_pages:(cid + 1) * list_pages]]
            lists[k] = list_layout(later, own)
            prp2 = own[0]
        slba = int(work.slba[i])
        s = sqes[k]
        s["opcode"], s["cid"], s["nsid"], s["prp1"], s["prp2"] = READ, cid, nsid, prp1, prp2
        s["cdw10"], s["cdw11"], s["cdw12"] = slba & 0xFFFFFFFF, slba >> 32, nblocks - 1
    return sqes, lists
