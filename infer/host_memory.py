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
  near the machine's memory stays mapped, and experts under a RAM tier's budget are left to that tier
  (infer.packed_weights decides which tensors come here)."""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20
LINE = 64
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
    """Bytes the system can give without swapping (psutil, as infer.tiers.budget reads it)."""
    import psutil

    return int(psutil.virtual_memory().available)


def choice() -> str:
    value = os.environ.get("NVMEDIRECT_HUGE_PAGES", "") or "auto"
    if value not in CHOICES:
        raise ValueError(f"NVMEDIRECT_HUGE_PAGES={value!r}: use one of {', '.join(CHOICES)} (or leave it unset)")
    return value


def should_copy(nbytes: int) -> bool:
    """Whether `nbytes` of weights go to huge pages under the rules of the module docstring."""
    return choice() == "auto" and nbytes > 0 and transparent_huge_pages() and 2 * nbytes <= available_memory()


def _huge_page_area(nbytes: int, advise: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous mapping and its `nbytes` bytes from a 2 MiB boundary, advised to huge pages
    (unless `advise` is False) before the first touch, so the faults take 2 MiB pages; where that is
    refused (a sandbox, a kernel built without it) small pages work too."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if advise:
        with contextlib.suppress(OSError):
            area.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(area, np.uint8)
    first = (-whole.ctypes.data) % HUGE_PAGE
    return area, whole[first:first + nbytes]


class HugePageCopy:
    """Byte ranges (offset, nbytes) of the file at `path` side by side in anonymous memory advised to
    huge pages, each at a 64-byte boundary (a cache line; GGUF aligns tensors to 32), read on `threads`
    threads, read-only once filled. `view(offset, nbytes)` gives the bytes of the file at `offset`,
    which must lie inside one range."""

    def __init__(self, path: str | Path, ranges: list[tuple[int, int]], threads: int = 2) -> None:
        ranges = sorted((int(o), int(n)) for o, n in ranges if n > 0)
        if not ranges or ranges[0][0] < 0:
            raise ValueError(f"no bytes to copy, or a negative offset: {ranges[:3]}")
        self.path = Path(path)
        self._starts, self._places, self._sizes, total = [], [], [], 0
        for offset, nbytes in ranges:
            self._starts.append(offset)
            self._places.append(total)
            self._sizes.append(nbytes)
            total = (total + nbytes + LINE - 1) // LINE * LINE
        self.nbytes = sum(self._sizes)
        self._map, self._bytes = _huge_page_area(total)
        self._fill(threads)
        self._bytes.flags.writeable = False

    def _fill(self, threads: int) -> None:
        """pread every range in pieces of at most READ_CHUNK on `threads` threads: the first touch of
        fresh memory is what costs (zeroing the pages; in a VM also the host's faults), and it spreads
        over cores."""
        pieces = [(offset + k, place + k, min(READ_CHUNK, nbytes - k))
                  for offset, place, nbytes in zip(self._starts, self._places, self._sizes, strict=True)
                  for k in range(0, nbytes, READ_CHUNK)]
        bar = None
        if self.nbytes >= PROGRESS_FROM:
            from tqdm import tqdm

            bar = tqdm(total=self.nbytes, unit="B", unit_scale=True, desc="weights into huge pages", leave=False,
                       file=sys.stderr)

        def read(fd: int, offset: int, place: int, nbytes: int) -> None:
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [memoryview(self._bytes[place + done:place + nbytes])], offset + done)
                if n <= 0:
                    raise OSError(f"{self.path}: the file ended at byte {offset + done} while its weights "
                                  f"were copied (it shrank after it was opened?)")
                done += n
            if bar is not None:
                bar.update(nbytes)

        fd = os.open(self.path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(max(1, threads)) as pool:
                list(pool.map(lambda piece: read(fd, *piece), pieces))
        finally:
            os.close(fd)
            if bar is not None:
                bar.close()

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        k = bisect.bisect_right(self._starts, offset) - 1
        if k < 0 or nbytes < 0 or offset + nbytes > self._starts[k] + self._sizes[k]:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) of the file are not inside one copied range")
        place = self._places[k] + offset - self._starts[k]
        return self._bytes[place:place + nbytes]

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


class HugePageSlots:
    """`count` slots of `nbytes` each (at 64-byte boundaries) in one anonymous mapping advised to huge
    pages, handed out and taken back: a cache that holds at most `count` items of at most `nbytes`
    (infer.tiers.experts' expert cache) keeps them where a decode streams them fastest, and its memory
    is bounded by the mapping (a page is only taken when first written)."""

    def __init__(self, count: int, nbytes: int) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"an arena of {count} slots of {nbytes} bytes holds nothing")
        self.count, self.nbytes = count, nbytes
        self.stride = (nbytes + LINE - 1) // LINE * LINE
        self._map, self._bytes = _huge_page_area(count * self.stride, advise=choice() == "auto")
        self._free = list(range(count - 1, -1, -1))  # the lowest slot first: fewer pages touched

    def take(self) -> tuple[int, np.ndarray]:
        """(slot, its `nbytes` bytes); ValueError when every slot is taken."""
        if not self._free:
            raise ValueError(f"all {self.count} slots are taken")
        slot = self._free.pop()
        return slot, self._bytes[slot * self.stride: slot * self.stride + self.nbytes]

    def give(self, slot: int) -> None:
        """Slot `slot` back (its bytes may be handed out again: nothing may still read them)."""
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)
