"""The reader's name for `nvmedirect.host_memory`, where these now live (below the store and the
reader both); infer/tiers imports them from here."""

from nvmedirect.host_memory import (
           PAGE_SIZE,
           address_of,
           aligned_empty,
           as_byte_array,
           gpu_present,
           is_pinned,
           pinned_empty,
)

PAGE = PAGE_SIZE

__all__ = ["PAGE", "PAGE_SIZE", "address_of", "aligned_empty", "as_byte_array", "gpu_present", "is_pinned",
           "pinned_empty"]
