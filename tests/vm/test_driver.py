"""Our NVMe driver against QEMU's emulated controller, in both VFIO modes: the guest modules under
tests/vm/guest/driver/ (identify, byte ranges, queue depths, several queue pairs, 4096-byte LBAs,
LBA out of range, writes, command timeouts and exit-time cleanup, a controller granting one queue
pair, tier C inference from it (a dense model's layers and a mixture of experts' routed experts), the GPU doorbell path's shared submitter on the GPU tests'
workloads) run in the boot each mode shares with the rig and system tests (tests/vm/shared_boot.py: driver_part configures the controllers).
"""

from __future__ import annotations

import numpy as np
import pytest
from shared_boot import WRITE_BYTES, WRITE_LBA, WRITE_SEED

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
    "test_the_reader_uses_the_one_queue_pair_granted",
    "test_bench_skips_queue_pairs_the_device_cannot_do",
    "test_ntransformer_streams_tier_c_from_the_device_in_its_vfio_mode",
    "test_ntransformer_tiers_experts_from_the_device",
    "test_the_gpu_workloads_read_the_right_bytes_through_the_shared_submitter[1515-64]",
    "test_the_gpu_workloads_read_the_right_bytes_through_the_shared_submitter[7-1]",
    "test_the_gpu_workloads_read_the_right_bytes_through_the_shared_submitter[42-17]",
    "test_probe_gpu_mmio_on_a_vfio_bound_controller_names_the_missing_gpu",
}


@pytest.mark.vm
@pytest.mark.slow
def test_driver_in_guest(vm_mode, shared_boot):
    boot = shared_boot(vm_mode)
    result = boot.result("driver")
    result.assert_passed()
    passed = {t.nodeid.rsplit("::", 1)[-1] for t in result.passed}
    assert passed >= MUST_PASS, f"guest tests that did not run: {sorted(MUST_PASS - passed)}"
    # The guest's writes reached the backing file, byte for byte, and nothing else changed.
    pattern = np.random.default_rng(WRITE_SEED).integers(0, 256, WRITE_BYTES, dtype=np.uint8).tobytes()
    written = boot.parts["driver"].files["write"].read_bytes()
    start = WRITE_LBA * 512
    assert written[start:start + len(pattern)] == pattern
    assert not any(written[:start]) and not any(written[start + len(pattern):])
