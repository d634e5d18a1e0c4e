"""An NVMe controller emulator for tests (native/nvme_emu.c): a thread watching doorbell words in a
host memory page that stands in for BAR0, validating every SQE strictly and reading a backing file
into the PRP targets. The CPU shim, the CPU reference submitter (`host_drive`) and GPU kernels all
drive it; nothing in the I/O path knows it is not a device.

The C library is compiled with gcc on first use into a cache directory keyed by the sources' hash
and loaded through cffi's ABI mode: no Python headers or setuptools are needed where it runs (the
GPU machine), and an edited source is never run stale.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from cffi import FFI

from nvmedirect.errors import NvmeDirectError

NATIVE = Path(__file__).resolve().parent.parent / "native"
SOURCES = ("nvme_emu.c", "nvme_emu_validate.c", "nvme_emu_host.c")
HEADERS = ("nvme_sqe.h", "nvme_ring.h", "nvme_emu.h")
COUNTERS = ("fetched", "completed", "bytes_read", "injected_errors", "injected_delays", "sq_doorbells",
            "cq_doorbells", "violations")

CDEF = """
struct nvd_sqe {
    uint8_t opcode; uint8_t flags; uint16_t cid; uint32_t nsid;
    uint32_t cdw2; uint32_t cdw3; uint64_t mptr; uint64_t prp1; uint64_t prp2;
    uint32_t cdw10; uint32_t cdw11; uint32_t cdw12; uint32_t cdw13; uint32_t cdw14; uint32_t cdw15;
};
struct nvd_ring {
    uint64_t sq, cq, sq_doorbell, cq_doorbell, lists, list_iovas, depth, cq_depth, queue_depth, list_pages;
    uint64_t nsid, lba_size, first, count, sq_tail, cq_head, cq_phase;
};
struct nvd_work { uint64_t slba, nblocks, dst_offset, dst_pages, dst_npages, status; };
struct nvd_emu;
struct nvd_emu *nvd_emu_create(const char *backing_path, uint32_t lba_size, uint64_t mdts_bytes, uint32_t dstrd,
                               uint32_t mqes);
uint64_t nvd_emu_bar(struct nvd_emu *emu);
uint64_t nvd_emu_bar_bytes(struct nvd_emu *emu);
uint64_t nvd_emu_nsze(struct nvd_emu *emu);
const char *nvd_emu_first_violation(struct nvd_emu *emu);
int nvd_emu_map(struct nvd_emu *emu, uint64_t iova, uint64_t host, uint64_t size);
int nvd_emu_unmap(struct nvd_emu *emu, uint64_t iova);
int nvd_emu_attach(struct nvd_emu *emu, uint32_t qid, uint64_t sq_iova, uint32_t sq_size, uint64_t cq_iova,
                   uint32_t cq_size);
int nvd_emu_detach(struct nvd_emu *emu, uint32_t qid);
void nvd_emu_inject_status(struct nvd_emu *emu, uint64_t modulo, uint64_t remainder, uint32_t sct, uint32_t sc);
void nvd_emu_inject_delay(struct nvd_emu *emu, uint64_t modulo, uint64_t remainder, uint64_t delay_ns);
void nvd_emu_set_idle_sleep(struct nvd_emu *emu, uint64_t ns);
uint64_t nvd_emu_counter(struct nvd_emu *emu, uint32_t which);
int nvd_emu_start(struct nvd_emu *emu);
void nvd_emu_stop(struct nvd_emu *emu);
void nvd_emu_destroy(struct nvd_emu *emu);
int64_t nvd_host_drive(struct nvd_ring *ring, const struct nvd_work *work, uint64_t timeout_ns);
int nvd_host_build(const struct nvd_ring *ring, const struct nvd_work *work, struct nvd_sqe *out);
"""

ffi = FFI()
ffi.cdef(CDEF)


def cache_dir() -> Path:
    base = os.environ.get("NVMEDIRECT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nvmedirect")
    return Path(base) / "native"


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:  # names too: a file added to the build changes the library
        digest.update(name.encode() + b"\0" + (NATIVE / name).read_bytes())
    return digest.hexdigest()[:16]


@cache
def library() -> Any:
    """The emulator library, compiled on first use (gcc), loaded through cffi's ABI mode."""
    target = cache_dir() / f"libnvme_emu-{source_hash()}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if compiler is None:
            raise NvmeDirectError("the NVMe emulator needs a C compiler (gcc) to build native/nvme_emu.c")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, "-O2", "-g", "-Wall", "-Wextra", "-std=gnu11", "-shared", "-fPIC", "-pthread",
                   f"-I{NATIVE}", *(str(NATIVE / s) for s in SOURCES), "-o", str(built)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                raise NvmeDirectError(f"building the NVMe emulator failed:\n{result.stderr[-3000:]}")
            built.replace(target)  # atomic: a concurrent builder never loads half a file
    return ffi.dlopen(str(target))


class EmulatedController:
    """One emulated controller over `backing` (namespace 1, `lba_size`-byte LBAs, transfers up to
    `mdts_bytes`), doorbells `4 << dstrd` bytes apart. The thread runs between start() and stop();
    use it as a context manager."""

    def __init__(self, backing: str | os.PathLike[str], lba_size: int = 512, mdts_bytes: int = 1 << 20,
                 dstrd: int = 0, mqes: int = 1023):
        self.lib = library()
        self.lba_size, self.mdts_bytes, self.dstrd = lba_size, mdts_bytes, dstrd
        self._emu = self.lib.nvd_emu_create(os.fsencode(backing), lba_size, mdts_bytes, dstrd, mqes)
        if self._emu == ffi.NULL:
            raise NvmeDirectError(f"cannot create an emulated controller over {backing} (missing or empty?)")
        self.bar_address = int(self.lib.nvd_emu_bar(self._emu))
        self.bar_bytes = int(self.lib.nvd_emu_bar_bytes(self._emu))
        self.nsze = int(self.lib.nvd_emu_nsze(self._emu))

    # -- configuration --------------------------------------------------------------------------
    def map(self, iova: int, host_address: int, nbytes: int) -> None:
        """Let the device reach host memory [host_address, +nbytes) at device address `iova`."""
        if self.lib.nvd_emu_map(self._emu, iova, host_address, nbytes):
            raise NvmeDirectError("the emulator's table of mapped regions is full")

    def unmap(self, iova: int) -> None:
        self.lib.nvd_emu_unmap(self._emu, iova)

    def attach(self, qid: int, sq_iova: int, sq_size: int, cq_iova: int, cq_size: int) -> None:
        """Create I/O queue pair `qid` on rings already mapped at those device addresses."""
        rc = self.lib.nvd_emu_attach(self._emu, qid, sq_iova, sq_size, cq_iova, cq_size)
        if rc:
            raise NvmeDirectError(f"attaching queue {qid} failed ({os.strerror(-rc)})")

    def detach(self, qid: int) -> None:
        self.lib.nvd_emu_detach(self._emu, qid)

    def doorbell(self, qid: int, is_cq: bool) -> int:
        """Host address of a queue's SQ tail (is_cq False) or CQ head doorbell word."""
        return self.bar_address + 0x1000 + (2 * qid + int(is_cq)) * (4 << self.dstrd)

    def doorbell_offset(self, qid: int, is_cq: bool) -> int:
        return self.doorbell(qid, is_cq) - self.bar_address

    def inject_status(self, modulo: int, remainder: int, sct: int, sc: int) -> None:
        """Fail every valid read whose SLBA % modulo == remainder with status (sct, sc); 0 stops."""
        self.lib.nvd_emu_inject_status(self._emu, modulo, remainder, sct, sc)

    def inject_delay(self, modulo: int, remainder: int, delay_s: float) -> None:
        """Hold back the completion of reads whose SLBA % modulo == remainder for `delay_s`."""
        self.lib.nvd_emu_inject_delay(self._emu, modulo, remainder, int(delay_s * 1e9))

    def set_idle_sleep(self, seconds: float) -> None:
        """0: spin while idle (benchmarks); else sleep this long (sharing a small CPU)."""
        self.lib.nvd_emu_set_idle_sleep(self._emu, int(seconds * 1e9))

    # -- state ----------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        return {name: int(self.lib.nvd_emu_counter(self._emu, i)) for i, name in enumerate(COUNTERS)}

    @property
    def violations(self) -> int:
        return int(self.lib.nvd_emu_counter(self._emu, COUNTERS.index("violations")))

    @property
    def first_violation(self) -> str:
        return ffi.string(self.lib.nvd_emu_first_violation(self._emu)).decode()

    def read_register(self, offset: int, width: int = 4) -> int:
        return int(ffi.cast("uint32_t *" if width == 4 else "uint64_t *", self.bar_address + offset)[0])

    # -- lifetime -------------------------------------------------------------------------------
    def start(self) -> EmulatedController:
        if self.lib.nvd_emu_start(self._emu):
            raise NvmeDirectError("cannot start the emulator thread")
        return self

    def stop(self) -> None:
        self.lib.nvd_emu_stop(self._emu)

    def close(self) -> None:
        if self._emu is not None:
            self.lib.nvd_emu_destroy(self._emu)
            self._emu = None

    def __enter__(self) -> EmulatedController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
