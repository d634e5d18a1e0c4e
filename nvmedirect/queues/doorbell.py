"""A doorbell register: one 32-bit MMIO store through the native shim.

The shim takes a plain address, so the same call works for a BAR mapped by the CPU and, later, a
BAR window mapped for the GPU (the GPU-MMIO doorbell path).
"""

from __future__ import annotations

from nvmedirect.vfio._ffi import lib


class Doorbell:
    """A submission-tail or completion-head doorbell at a mapped address."""

    __slots__ = ("address", "_owner")

    def __init__(self, address: int, owner: object = None):
        self.address = address
        self._owner = owner  # keeps the mapping alive while the doorbell exists

    def ring(self, value: int) -> None:
        lib.nvd_doorbell_write(self.address, value)
