"""Applying file edits with byte-identical backups, a journal of what was done, and rollback.

The journal (/var/lib/nvmedirect/setup-journal.json under the root) lists runs; each run lists
the files it wrote with the backup of what was there before (or that nothing was), and a hash of
what it wrote, so rollback can tell whether someone changed the file since.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from nvmedirect.system.sysview import SystemView

STATE_DIR = "/var/lib/nvmedirect"
JOURNAL = f"{STATE_DIR}/setup-journal.json"
BACKUPS = f"{STATE_DIR}/backups"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FileEdit:
    path: str  # absolute, as seen inside the root
    new: bytes


class Journal:
    def __init__(self, view: SystemView):
        self.view = view
        self.file = view.path(JOURNAL)

    def load(self) -> dict:
        try:
            data = json.loads(self.file.read_text())
        except FileNotFoundError:
            return {"runs": []}
        except (OSError, ValueError) as exc:
            raise OSError(f"setup journal {self.file} is unreadable ({exc}); nothing was changed") from None
        return data if isinstance(data.get("runs"), list) else {"runs": []}

    def save(self, data: dict) -> None:
        _atomic_write(self.file, (json.dumps(data, indent=2) + "\n").encode(), 0o644)

    # -- apply --------------------------------------------------------------------------------
    def apply(self, steps: list[str], edits: list[FileEdit], actions: list[dict] = ()) -> dict:
        """Back up and rewrite each file, then record the run. Backups are copies with the same
        bytes and mode; a file that did not exist is recorded as such and deleted on rollback."""
        data = self.load()
        # Run ids name the backup folders: unique even for two runs in the same second.
        run_id = time.strftime("%Y%m%dT%H%M%S") + f"-{len(data['runs']) + 1}"
        while self.view.path(f"{BACKUPS}/{run_id}").exists():
            run_id += "x"
        run = {"id": run_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": steps, "files": [],
               "actions": list(actions)}
        for edit in edits:
            real = self.view.path(edit.path)
            entry = {"path": edit.path, "backup": None, "mode": None, "sha256_after": sha256(edit.new)}
            if real.exists():
                backup = f"{BACKUPS}/{run_id}{edit.path}"
                self.view.path(backup).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(real, self.view.path(backup))
                entry["backup"] = backup
                st = real.stat()
                entry["mode"], entry["owner"] = st.st_mode & 0o7777, [st.st_uid, st.st_gid]
                entry["sha256_before"] = sha256(real.read_bytes())
            run["files"].append(entry)
        data["runs"].append(run)
        self.save(data)  # the journal names the backups before any file changes
        for edit, entry in zip(edits, run["files"], strict=True):
            _atomic_write(self.view.path(edit.path), edit.new, entry["mode"] if entry["mode"] is not None else 0o644)
        return run

    def record_action(self, action: dict) -> None:
        data = self.load()
        if not data["runs"]:
            data["runs"].append({"id": time.strftime("%Y%m%dT%H%M%S"), "steps": [], "files": [], "actions": []})
        data["runs"][-1].setdefault("actions", []).append(action)
        self.save(data)

    # -- rollback -----------------------------------------------------------------------------
    def conflicts(self) -> list[str]:
        """Files changed by someone else since we last wrote them (rollback would lose their edit)."""
        latest: dict[str, dict] = {}
        for run in self.load()["runs"]:
            for entry in run["files"]:
                latest[entry["path"]] = entry
        return [path for path, entry in latest.items()
                if (current := self.view.read_bytes(path)) is None or sha256(current) != entry["sha256_after"]]

    def rollback(self, force: bool = False) -> list[str]:
        """Undo every run, newest first, restoring the original bytes and mode of each file."""
        data = self.load()
        changed = self.conflicts()
        if changed and not force:
            raise RollbackConflict(changed)
        done = []
        for run in reversed(data["runs"]):
            for entry in reversed(run["files"]):
                real = self.view.path(entry["path"])
                if entry["backup"] is None:
                    if real.exists():
                        real.unlink()
                    done.append(f"removed {entry['path']} (it did not exist before)")
                else:
                    backup = self.view.path(entry["backup"])
                    _atomic_write(real, backup.read_bytes(), entry["mode"])
                    shutil.copystat(backup, real)
                    if entry.get("owner") and os.geteuid() == 0:
                        os.chown(real, *entry["owner"])
                    done.append(f"restored {entry['path']}")
            shutil.rmtree(self.view.path(f"{BACKUPS}/{run['id']}"), ignore_errors=True)
        self.file.unlink(missing_ok=True)
        return done

    def actions(self) -> list[dict]:
        return [a for run in self.load()["runs"] for a in run.get("actions", [])]


class RollbackConflict(Exception):
    def __init__(self, paths: list[str]):
        super().__init__(f"changed since setup wrote them: {', '.join(paths)} (rollback would lose those "
                         "edits; compare with the backups under /var/lib/nvmedirect/backups, or use --force)")
        self.paths = paths


def _atomic_write(path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
