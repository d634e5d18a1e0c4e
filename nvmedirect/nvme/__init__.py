"""The NVMe layer on top of VFIO: controller bring-up, admin commands, namespaces, I/O.

Layers, bottom up: `nvmedirect.spec` (registers, entries, Identify layouts, statuses) →
`nvmedirect.queues` (rings, trackers, PRPs) → `controller` (bring-up, admin commands, queue pairs)
→ `namespace` (builds I/O commands, byte-range reads).
"""

from nvmedirect.nvme.controller import Controller
from nvmedirect.nvme.namespace import Namespace
from nvmedirect.spec.status import NvmeStatus

__all__ = ["Controller", "Namespace", "NvmeStatus"]
