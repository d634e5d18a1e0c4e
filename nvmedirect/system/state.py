"""The bind state file: what each controller was before `bind` took it, so `restore` can undo it
after a crash, a reboot of the tool, or a Ctrl-C.

Written atomically (temporary file, fsync, rename) before anything on the device changes. It lives
in /run (a tmpfs): a binding to vfio-pci does not survive a reboot, so neither should the record of it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from nvmedirect.system.sysview import SystemView

STATE_FILE = "/run/nvmedirect/bound.json"


class StateFile:
    """`{bdf: record}` where a record holds the original driver and override, the names the
    kernel gave the controller and its namespaces, and the phase the last operation reached."""

    def __init__(self, view: SystemView, path: str = STATE_FILE):
        self.path: Path = view.path(path)

    def load(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise OSError(f"state file {self.path} is unreadable ({exc}); fix or remove it by hand") from None
        return data if isinstance(data, dict) else {}

    def get(self, bdf: str) -> dict | None:
        return self.load().get(bdf)

    def put(self, bdf: str, record: dict) -> None:
        data = self.load()
        data[bdf] = {**record, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self._save(data)

    def update(self, bdf: str, **fields) -> None:
        data = self.load()
        data.setdefault(bdf, {}).update(fields)
        self._save(data)

    def remove(self, bdf: str) -> None:
        data = self.load()
        if data.pop(bdf, None) is not None:
            self._save(data)

    def remembered_names(self) -> dict[str, list[str]]:
        """BDF -> controller and namespace names recorded at bind time."""
        out = {}
        for bdf, rec in self.load().items():
            names = [rec["name"]] if rec.get("name") else []
            names += [ns["name"] for ns in rec.get("namespaces", [])]
            out[bdf] = names
        return out

    def _save(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".bound.", suffix=".json")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(data, out, indent=2, sort_keys=True)
                out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
