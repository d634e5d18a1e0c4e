"""Which path reaches the device the user named: userspace driver, kernel block device, or image.

The user may name a controller by PCI address or a namespace by its /dev name, whichever driver has
it now: a controller on vfio-pci goes through our driver; one on the kernel's nvme driver through its
namespace's block device with O_DIRECT; a /dev/nvmeXnY that vanished because `nvmedirect bind` handed
its controller to vfio-pci is found again through the bind state file.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

from nvmedirect.store.safety import block_device_refusals

NVME = "nvme"  # through the userspace driver; `path` is the BDF
BLOCK = "block"  # a kernel block device; `path` is /dev/...
IMAGE = "image"  # a regular file standing in for a device

_NAMESPACE = re.compile(r"n(\d+)$")


class RouteError(ValueError):
    """The name matches no device or file; the message says why."""


@dataclass
class Route:
    kind: str
    path: str
    nsid: int = 1
    refusals: list[str] = field(default_factory=list)  # why writing there is not allowed


def route_device(text: str, nsid: int = 1) -> Route:
    """The path to `text` (BDF, /dev/nvmeXnY, another block device, or an image file)."""
    if os.path.exists(text):
        mode = os.stat(text).st_mode
        if stat.S_ISBLK(mode):
            return Route(BLOCK, text, refusals=block_device_refusals(text))
        if stat.S_ISREG(mode):
            return Route(IMAGE, text)
        raise RouteError(f"{text} is neither a block device nor a regular file")
    return _route_controller(text, nsid)


def _route_controller(text: str, nsid: int) -> Route:
    from nvmedirect.system.devices import TargetError, read_controller, resolve_target
    from nvmedirect.system.safety import FREE, VFIO, assess
    from nvmedirect.system.state import StateFile
    from nvmedirect.system.sysview import SystemView
    from nvmedirect.system.usage import UsageIndex

    view = SystemView()
    state = StateFile(view)
    try:
        bdf = resolve_target(view, text, state.remembered_names())
    except (TargetError, OSError) as exc:
        raise RouteError(f"no such device or image file: {text} ({exc})") from None
    if (match := _NAMESPACE.search(os.path.basename(text))) and text.startswith(("/dev/nvme", "nvme")):
        nsid = int(match.group(1))
    ctrl = read_controller(view, bdf)
    verdict = assess(ctrl, UsageIndex(view), state.get(bdf))
    if verdict.state == VFIO:
        return Route(NVME, bdf, nsid)
    if verdict.state == FREE or verdict.refused:
        suffix = f"n{nsid}"
        names = [n for n in ctrl.block_devices if n.endswith(suffix)]
        if names:
            device = f"/dev/{names[0]}"
            return Route(BLOCK, device, nsid, block_device_refusals(device))
    return Route(NVME, bdf, nsid, [f"{bdf}: {verdict.summary()}"])
