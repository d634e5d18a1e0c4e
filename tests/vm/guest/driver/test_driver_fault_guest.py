"""Inside the VM: a command that cannot complete surfaces as a named timeout within its deadline,
and a process that exits without cleaning up still leaves the device released and the DMA unmapped."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from driver_setup import FAULT_SERIAL, image_bytes, spec

from nvmedirect.nvme.controller import Controller

TIMEOUT_S = 1.0
SLACK_S = 2.0  # polling granularity plus a TCG guest's sluggishness


def test_command_timeout_is_named_and_exit_unmaps(bound, vm_mode):
    bdf = bound(FAULT_SERIAL)
    drive = f"{spec(FAULT_SERIAL)['qemu_id']}n1"
    child = Path(__file__).with_name("timeout_child.py")
    env = os.environ | {"PYTHONPATH": str(child.parents[1])}  # for vmguest
    run = subprocess.run([sys.executable, str(child), bdf, drive, vm_mode, str(TIMEOUT_S)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["error"] == "CommandTimeout" and report["is_timeout"], report
    assert report["message"].startswith("ERROR status: 08/01 Command Timeout"), report
    assert TIMEOUT_S <= report["elapsed_s"] < TIMEOUT_S + SLACK_S, report
    batch = report["batch"]
    assert batch["error"] == "CommandTimeout" and batch["message"].startswith("ERROR status: 08/01"), batch
    assert TIMEOUT_S <= batch["elapsed_s"] < TIMEOUT_S + SLACK_S, batch
    assert report["live_mappings_before_exit"] > 0
    # The interpreter-exit handler shut the controller down and unmapped everything.
    assert "controller: closed; 0 DMA mappings left" in run.stderr, run.stderr[-3000:]
    # The group was released: a new owner brings the controller up and reads correct data.
    image = image_bytes(FAULT_SERIAL)
    with Controller.open(bdf, noiommu=vm_mode == "noiommu") as ctrl:
        got = bytearray(100_000)
        ctrl.namespace(1).read_into(got, 4097, len(got))
        assert hashlib.sha256(got).digest() == hashlib.sha256(image[4097:104097]).digest()
