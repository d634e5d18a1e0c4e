"""A view of the running system's pseudo-files (sysfs, procfs, /etc) under a chosen root.

Every probe in `nvmedirect.system` reads through a `SystemView`, so tests can point it at a fake
tree in a temporary directory and the commands can run against another root (`--root DIR`).
"""

from __future__ import annotations

import os
from pathlib import Path


class SystemView:
    """Reads (and, for bind/restore, writes) files of one system, rooted at `root`."""

    def __init__(self, root: Path | str = Path("/")):
        self.root = Path(root)

    @property
    def is_live(self) -> bool:
        """True when this view is the running system itself (not a fake or foreign tree)."""
        return self.root.resolve() == Path("/")

    def path(self, absolute: str | os.PathLike) -> Path:
        """The real location of `absolute` (a path as seen inside the root)."""
        return self.root / str(absolute).lstrip("/")

    def exists(self, absolute: str) -> bool:
        return self.path(absolute).exists()

    def read(self, absolute: str, default: str | None = None) -> str | None:
        """Text of a file, stripped; `default` where it is missing or unreadable."""
        try:
            return self.path(absolute).read_text(errors="replace").strip()
        except OSError:
            return default

    def read_bytes(self, absolute: str) -> bytes | None:
        try:
            return self.path(absolute).read_bytes()
        except OSError:
            return None

    def listdir(self, absolute: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(absolute)))
        except OSError:
            return []

    def link_name(self, absolute: str) -> str | None:
        """Last component of a symlink's target (how sysfs names drivers and groups)."""
        try:
            return os.path.basename(os.readlink(self.path(absolute)))
        except OSError:
            return None

    def link_target(self, absolute: str) -> str | None:
        """A symlink's target as seen inside the root, made absolute."""
        try:
            target = os.readlink(self.path(absolute))
        except OSError:
            return None
        if not os.path.isabs(target):
            target = os.path.normpath(os.path.join(os.path.dirname(absolute), target))
        return target

    def write(self, absolute: str, text: str) -> None:
        """Write a sysfs attribute in one write() call, as the kernel expects."""
        fd = os.open(self.path(absolute), os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"SystemView({str(self.root)!r})"
