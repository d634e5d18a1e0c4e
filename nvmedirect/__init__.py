"""nvmedirect: drive NVMe SSDs from user space through VFIO.

Layers, bottom up: `nvmedirect.vfio` (container, group, device, DMA), `nvmedirect.queues`
(submission/completion rings and commands), the controller/namespace layer, and readers for
consumers such as the `infer` streaming engine.
"""

__version__ = "0.1.0"
