"""Physical Region Page (PRP) entries: how a command tells the controller where its data lives.

With a 4 KiB memory page size: PRP1 is the address of the first byte (any dword-aligned offset);
if the data ends inside the second page, PRP2 is that page; otherwise PRP2 points to a PRP list of
page addresses. A list page holds 512 entries; when more are needed its last entry points to the
next list page (a chain). The entries are built in C (`nvd_build_prps`, native/nvme_queue.c); this
module sizes the list pages each command slot owns.
"""

from __future__ import annotations

from nvmedirect.host_memory import PAGE_SIZE

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
