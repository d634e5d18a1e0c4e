"""Physical Region Page (PRP) entries: how a command tells the controller where its data lives.

With a 4 KiB memory page size: PRP1 is the address of the first byte (any dword-aligned offset);
if the data ends inside the second page, PRP2 is that page; otherwise PRP2 points to a PRP list of
page addresses. A list page holds 512 entries; when more are needed its last entry points to the
next list page (a chain).
"""

from __future__ import annotations

import numpy as np

from nvmedirect.errors import DmaError

PAGE_SIZE = 4096
ENTRIES_PER_LIST_PAGE = PAGE_SIZE // 8


def list_pages_needed(max_transfer: int) -> int:
    """PRP list pages one command of up to `max_transfer` bytes (any start offset) can need."""
    data_pages = max_transfer // PAGE_SIZE + 1  # an unaligned start touches one extra page
    entries = data_pages - 1  # PRP1 covers the first page
    if entries <= 1:
        return 0
    # Every list page but the last gives one entry to the chain pointer.
    pages = 1
    while pages * (ENTRIES_PER_LIST_PAGE - 1) + 1 < entries:
        pages += 1
    return pages


def build_prps(first_address: int, data_pages: np.ndarray, nbytes: int,
               list_entries: np.ndarray | None, list_page_addresses: np.ndarray | None) -> tuple[int, int]:
    """Return (PRP1, PRP2) for `nbytes` starting at device address `first_address`.

    `data_pages` are the device addresses of the 4 KiB pages the data touches (the first one is
    not used: PRP1 is `first_address`). When a list is needed it is written into `list_entries`
    (a uint64 view over the command's list pages, whose device addresses are `list_page_addresses`).
    """
    if nbytes <= 0:
        raise DmaError(f"transfer length must be positive, got {nbytes}")
    if first_address & 0x3:
        raise DmaError(f"PRP1 {first_address:#x} is not dword aligned")
    offset = first_address % PAGE_SIZE
    page_count = (offset + nbytes + PAGE_SIZE - 1) // PAGE_SIZE
    if len(data_pages) < page_count:
        raise DmaError(f"{nbytes} bytes at offset {offset} span {page_count} pages, buffer has {len(data_pages)}")
    if page_count == 1:
        return first_address, 0
    if page_count == 2:
        return first_address, int(data_pages[1])
    rest = data_pages[1:page_count]
    if list_entries is None or list_page_addresses is None:
        raise DmaError(f"a {nbytes}-byte transfer needs a PRP list and none was provided")
    remaining = len(rest)
    taken = 0
    for list_index in range(len(list_page_addresses)):
        base = list_index * ENTRIES_PER_LIST_PAGE
        if remaining <= ENTRIES_PER_LIST_PAGE:
            list_entries[base:base + remaining] = rest[taken:]
            return first_address, int(list_page_addresses[0])
        chunk = ENTRIES_PER_LIST_PAGE - 1
        list_entries[base:base + chunk] = rest[taken:taken + chunk]
        # The last slot of a full list page points to the next list page.
        list_entries[base + chunk] = list_page_addresses[list_index + 1] if list_index + 1 < len(
            list_page_addresses) else 0
        taken += chunk
        remaining -= chunk
    raise DmaError(f"a {nbytes}-byte transfer needs more PRP list pages than the command has")
