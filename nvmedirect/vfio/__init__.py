"""VFIO: container, group, device and DMA mappings, over the system's <linux/vfio.h> via cffi."""

from nvmedirect.vfio.container import Container
from nvmedirect.vfio.device import MappedBar, Region, VfioDevice
from nvmedirect.vfio.dma import DmaAllocator, DmaBuffer, IommuDma, NoIommuDma, allocator_for
from nvmedirect.vfio.group import Group, group_number

__all__ = ["Container", "DmaAllocator", "DmaBuffer", "Group", "IommuDma", "MappedBar", "NoIommuDma", "Region",
           "VfioDevice", "allocator_for", "group_number"]
