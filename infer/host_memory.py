"""The packed CPU engine's weights copied out of the mapped file into anonymous memory on transparent
huge pages (2 MiB), where the machine allows it.

Why: a decode step reads every weight once, so the CPU engine runs at the speed the cores stream
memory. Through the file's mapping that stream crosses a 4 KiB page every 4 KiB (a TLB miss each, and
in a virtual machine a walk of two sets of page tables), and its pages are wherever the page cache put
them. On the 2-core Zen 4 VM of docs/INFERENCE.md, alternating runs of the same decode
(bench.cpu_decode, NVMEDIRECT_HUGE_PAGES=auto then off) gave the 1.5B 31.3-32.2 against 27.0-29.6
tok/s and the 0.5B 70.9-75.1 against 65.9-69.4. Bare two-thread reads there move with the host's
backing of the guest's memory (29-34 GB/s from the mapped file, 31-54 from anonymous memory, from one
hour to the next), so the decode runs are the measurement, not those.

The copy is read with pread (no mapping of the file is touched, so the process's resident memory stays
about the file's size), and only made where it is cheap and safe:
- NVMEDIRECT_HUGE_PAGES=off keeps the map; `auto` (the default) copies when the kernel offers
  transparent huge pages (`always` or `madvise`) and the bytes are at most half of MemAvailable;
- anonymous memory cannot be given back under pressure the way the file's page cache can, so a model
  near the machine's memory stays mapped (and so does anything the tiers place: they read their own).
"""

from __future__ import annotations

import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
CHOICES = ("auto", "off")
READ_CHUNK = 64 << 20
PROGRESS_FROM = 2 << 30  # copies this large show a progress bar (a few seconds from a cold disk)


def transparent_huge_pages() -> bool:
    """Whether the kernel gives huge pages to an anonymous mapping that asks (MADV_HUGEPAGE)."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def choice() -> str:
    value = os.environ.get("NVMEDIRECT_HUGE_PAGES", "") or "auto"
    if value not in CHOICES:
        raise ValueError(f"NVMEDIRECT_HUGE_PAGES={value!r}: use one of {', '.join(CHOICES)} (or leave it unset)")
    return value


def should_copy(nbytes: int) -> bool:
    """Whether `nbytes` of weights go to huge pages under the rules of the module docstring."""
    return choice() == "auto" and nbytes > 0 and transparent_huge_pages() and 2 * nbytes <= available_memory()


class HugePageCopy:
    """Bytes [start, end) of the file at `path` in anonymous memory advised to huge pages, placed so
    that file offsets keep their alignment modulo 2 MiB, read on `threads` threads, read-only once
    filled. `view(offset, n)` takes a file offset."""

    def __init__(self, path: str | Path, start: int, end: int, threads: int = 2) -> None:
        if not 0 <= start < end:
            raise ValueError(f"an empty or negative range [{start}, {end})")
        self.path, self.start, self.end = Path(path), start, end
        lead = start % HUGE_PAGE  # the copy keeps the file's offsets modulo 2 MiB
        self._map = mmap.mmap(-1, lead + (end - start) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the faults then take 2 MiB pages
        whole = np.frombuffer(self._map, np.uint8)
        first = (-whole.ctypes.data) % HUGE_PAGE + lead
        self._bytes = whole[first:first + (end - start)]
        self._fill(threads)
        self._bytes.flags.writeable = False

    def _fill(self, threads: int) -> None:
        """pread the range in chunks on `threads` threads: the first touch of fresh memory is what costs
        (zeroing the pages; in a VM also the host's faults), and it spreads over cores."""
        total = self.end - self.start
        bar = None
        if total >= PROGRESS_FROM:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="weights into huge pages", leave=False,
                       file=sys.stderr)

        def chunk(fd: int, first: int) -> int:
            last = min(total, first + READ_CHUNK)
            done = first
            while done < last:
                n = os.preadv(fd, [memoryview(self._bytes[done:last])], self.start + done)
                if n <= 0:
                    raise OSError(f"{self.path}: the file ended at byte {self.start + done} while its weights "
                                  f"were copied (it shrank after it was opened?)")
                done += n
            if bar is not None:
                bar.update(last - first)
            return last - first

        fd = os.open(self.path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(max(1, threads)) as pool:
                list(pool.map(lambda first: chunk(fd, first), range(0, total, READ_CHUNK)))
        finally:
            os.close(fd)
            if bar is not None:
                bar.close()

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if not self.start <= offset <= offset + nbytes <= self.end:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside the copy [{self.start}, {self.end})")
        return self._bytes[offset - self.start:offset - self.start + nbytes]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def huge_bytes(self) -> int:
        """How much of the copy the kernel placed on huge pages (AnonHugePages of this mapping, from
        /proc/self/smaps; 0 where it cannot be read)."""
        address = self._bytes.ctypes.data
        try:
            lines = Path("/proc/self/smaps").read_text().splitlines()
        except OSError:
            return 0
        inside = False
        for line in lines:
            head = line.split()[0] if line else ""
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
        return 0
