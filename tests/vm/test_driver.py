"""Our NVMe driver against QEMU's emulated controller, in both VFIO modes: one boot per mode runs
the guest modules under tests/vm/guest/driver/ (identify, byte ranges, queue depths, several queue
pairs, 4096-byte LBAs, LBA out of range, writes, a command timeout and exit-time cleanup).
"""

from __future__ import annotations

import numpy as np
import pytest
from rig import MIB, NvmeSpec, VmConfig

GUEST_MODULES = ["tests/vm/guest/driver/test_driver_guest.py", "tests/vm/guest/driver/test_driver_fault_guest.py"]
WRITE_SEED = 20261130
WRITE_LBA = 2048
MUST_PASS = {
    "test_identify_returns_qemu_serial_and_model",
    "test_identify_command_line",
    "test_random_byte_ranges_match_the_image[bytearray]",
    "test_random_byte_ranges_match_the_image[dma]",
    "test_queue_depths[1]",
    "test_queue_depths[64]",
    "test_two_queue_pairs_in_flight_together",
    "test_read_beyond_the_namespace_is_lba_out_of_range",
    "test_4096_byte_lbas_and_chained_prp_lists",
    "test_writes_then_reads_round_trip",
    "test_controller_reset_fails_in_flight_commands_and_recovers",
    "test_close_unmaps_and_the_device_can_be_reopened",
    "test_command_timeout_is_named_and_exit_unmaps",
    "test_benchmark_measures_both_drivers",
}


def random_image(path, size: int, seed: int):
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


@pytest.mark.vm
@pytest.mark.slow
def test_driver_in_guest(vm_mode, guest_pytest, tmp_path):
    write_image = tmp_path / "write.img"
    write_image.write_bytes(bytes(16 * MIB))
    config = VmConfig(
        iommu=vm_mode == "iommu",
        controllers=[
            NvmeSpec("nvd-drv-read", image=random_image(tmp_path / "read.img", 64 * MIB, 1)),
            NvmeSpec("nvd-drv-4k", image=random_image(tmp_path / "4k.img", 16 * MIB, 2),
                     logical_block_size=4096, mdts=0),
            NvmeSpec("nvd-drv-write", image=write_image),
            NvmeSpec("nvd-drv-fault", image=random_image(tmp_path / "fault.img", 8 * MIB, 3)),
        ],
    )
    result = guest_pytest(config, GUEST_MODULES, timeout=900,
                          env={"NVD_WRITE_SEED": str(WRITE_SEED), "NVD_WRITE_LBA": str(WRITE_LBA)})
    result.assert_passed()
    passed = {t.nodeid.rsplit("::", 1)[-1] for t in result.passed}
    assert passed >= MUST_PASS, f"guest tests that did not run: {sorted(MUST_PASS - passed)}"
    # The guest's writes reached the backing file, byte for byte, and nothing else changed.
    pattern = np.random.default_rng(WRITE_SEED).integers(0, 256, 3 * MIB, dtype=np.uint8).tobytes()
    written = write_image.read_bytes()
    start = WRITE_LBA * 512
    assert written[start:start + len(pattern)] == pattern
    assert not any(written[:start]) and not any(written[start + len(pattern):])
