"""The NVMe layer on top of VFIO: spec structures, status codes, controller bring-up, namespaces, I/O.

Layers, bottom up: `spec` (registers, entries, Identify layouts) → `nvmedirect.queues` (rings,
trackers, PRPs) → `controller` (bring-up, admin commands, queue pairs) → `namespace` (builds I/O
commands, byte-range reads). Submodules load on first use so the queue layer can import `status`
without pulling in the controller.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Controller": "controller", "Namespace": "namespace", "NvmeStatus": "status"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"nvmedirect.nvme.{_EXPORTS[name]}"), name)
    raise AttributeError(name)


__all__ = list(_EXPORTS)
