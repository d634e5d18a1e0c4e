"""Tier C losing its device while `ntransformer --streaming --tier-c nvme` reads it, in both VFIO
modes (issue 29): the controller hot-unplugged (QMP device_del: the kernel's device request reaches
the driver through VFIO's REQ interrupt) and its drive removed under it (QMP drive_del: reads fail
on the device). Each ends the run with one line and exit code 1, and the device released. The
guest side is tests/vm/guest/test_unplug_guest.py; its own boot (the shared boots have no room for
two more controllers in the IOMMU mode)."""

from __future__ import annotations

import shutil

import pytest
from rig import NvmeSpec, VmConfig
from shared_boot import stored_model_image

MUST_PASS = {"test_a_hot_unplug_while_generating_releases_the_device_and_is_one_line",
             "test_a_drive_removed_while_generating_is_one_line_naming_the_lbas"}


@pytest.mark.vm
@pytest.mark.slow
def test_tier_c_device_faults_in_guest(vm_mode, guest_pytest, tmp_path):
    model, image, _, _ = stored_model_image(tmp_path)
    second = shutil.copy(image, tmp_path / "model-b.img")
    config = VmConfig(iommu=vm_mode == "iommu", controllers=[
        NvmeSpec("nvd-unplug-req", image=image), NvmeSpec("nvd-unplug-drive", image=second)])
    result = guest_pytest(config, ["tests/vm/guest/test_unplug_guest.py"], timeout=900,
                          env={"NVD_UNPLUG_MODEL": str(model)})
    result.assert_passed()
    passed = {t.nodeid.rsplit("::", 1)[-1] for t in result.passed}
    assert passed >= MUST_PASS, f"guest tests that did not run: {sorted(MUST_PASS - passed)}"
