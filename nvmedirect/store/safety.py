"""May write-gguf write to this device? Uses the same usage index as `nvmedirect list/bind`.

A kernel block device is refused when it is the boot device, mounted, swap, held by a stacked
device (LVM, MD, dm-crypt), or open by another process — for the whole disk, its partitions and
anything stacked on them. Partitions themselves are refused: models go on whole namespaces.
Signature checks (a filesystem or partition table in the first sectors) are separate
(`signatures.detect_signatures`), because `--force` may override those but never these.
"""

from __future__ import annotations

import os
import stat

from nvmedirect.system.sysview import SystemView
from nvmedirect.system.usage import UsageIndex


def disk_name(path: str) -> tuple[str, bool]:
    """(kernel name, is_partition) of a block device node."""
    rdev = os.stat(path).st_rdev
    sysfs = os.path.realpath(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}")
    return os.path.basename(sysfs), os.path.exists(os.path.join(sysfs, "partition"))


def block_device_refusals(path: str) -> list[str]:
    """Why writing raw LBAs of `path` would destroy something in use; empty when it may be written."""
    if not stat.S_ISBLK(os.stat(path).st_mode):
        return []  # an image file: nothing of the system's lives in it
    name, is_partition = disk_name(path)
    if is_partition:
        return [f"{path} is a partition ({name}): write models to a whole namespace"]
    reasons: list[str] = []
    for use in UsageIndex(SystemView()).uses(name):
        text = ("boot device (never written): " if use.kind == "boot" else "") + use.describe()
        if text not in reasons:
            reasons.append(text)
    return reasons
