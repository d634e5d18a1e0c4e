"""Inside the VM: a controller that grants one I/O queue pair (QEMU max_ioqpairs=1) holding a model
stored by `write-gguf`. The reader uses the one pair it gets, `bench` skips the counts the device
cannot do, and `ntransformer --tier-c nvme` streams from it in this boot's VFIO mode without being
told which mode that is: a dense model's layers, and a mixture of experts' routed experts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from driver_setup import ONE_QPAIR_SERIAL

from nvmedirect.cli import main as nvmedirect_main
from nvmedirect.reader import open_model
from nvmedirect.reader.nvme_backend import FewerQueuePairs, NvmeBackend

MODEL = Path(os.environ.get("NVD_STORED_MODEL", "/nonexistent"))
MOE = Path(os.environ.get("NVD_STORED_MOE", "/nonexistent"))  # after MODEL in the device's chain
MOE_LBA = os.environ.get("NVD_STORED_MOE_LBA", "0")


@pytest.fixture(scope="module")
def bdf(bound) -> str:
    return bound(ONE_QPAIR_SERIAL)


def test_the_reader_uses_the_one_queue_pair_granted(bdf):
    with pytest.warns(FewerQueuePairs, match="grants 1 I/O queue pair"):
        backend = NvmeBackend.open(bdf)  # asks for two, in whichever VFIO mode the group is
    assert backend.queue_pairs == 1
    backend.close()
    backend.close()
    with pytest.warns(FewerQueuePairs), open_model(bdf) as model:
        raw = np.fromfile(MODEL, dtype=np.uint8)
        for info in model.tensors.values():
            assert np.array_equal(model.read_tensor(info.name), raw[info.offset:info.offset + info.nbytes]), info.name


def test_bench_skips_queue_pairs_the_device_cannot_do(bdf):
    result = CliRunner().invoke(nvmedirect_main, ["bench", "--device", bdf, "--size", "4M", "--qd", "1,4",
                                                  "--io-size", "128K", "--qpairs", "1,2", "--no-dd",
                                                  "--no-kernel-compare", "--no-gpu", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(r["queue_pairs"], r["queue_depth"]) for r in data["rows"]] == [(1, 1), (1, 4)]
    assert any("--qpairs 2 skipped" in note for note in data["notes"]), data["notes"]


def generate(tier_c: str, bdf: str) -> tuple[str, str]:
    from infer.cli import main as ntransformer

    result = CliRunner().invoke(ntransformer, ["-m", str(MODEL), "--streaming", "--tier-c", tier_c,
                                               "--nvme-device", bdf, "--device", "cpu", "-p", "hello",
                                               "-n", "4", "-t", "0"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert f"staged read ({tier_c})" in result.stderr, result.stderr  # the plan really reads tier C there
    return result.stdout, result.stderr


def test_ntransformer_streams_tier_c_from_the_device_in_its_vfio_mode(bdf):
    """The fewer-queue-pairs notice is one `note:` line from the command line (issue 29), not
    Python's warning format with a source line."""
    from_device, said = generate("nvme", bdf)
    notes = [line for line in said.splitlines() if "grants 1 I/O queue pair" in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: {bdf} nsid 1: the controller grants 1"), said
    assert "FewerQueuePairs" not in said and ".py:" not in said, said
    assert from_device.strip() and from_device == generate("file", bdf)[0]


def test_ntransformer_tiers_experts_from_the_device(bdf):
    """Issue 26: a mixture of experts on the CPU engine with a RAM budget below its experts reads the
    routed ones through the driver, and its text is the all-RAM run's."""
    from infer.cli import main as ntransformer

    common = ["-m", str(MOE), "--device", "cpu", "-p", "hello there", "-n", "8", "-t", "0"]
    resident = CliRunner().invoke(ntransformer, common)
    assert resident.exit_code == 0, f"{resident.output}\n{resident.exception!r}"
    tiered = CliRunner().invoke(ntransformer, [*common, "--streaming", "--tier-c", "nvme", "--nvme-device", bdf,
                                               "--nvme-lba", MOE_LBA, "--ram-budget", "600KB"])
    assert tiered.exit_code == 0, f"{tiered.output}\n{tiered.exception!r}"
    assert "nvme" in tiered.stderr and "misses" in tiered.stderr, tiered.stderr
    assert tiered.stdout.strip() and tiered.stdout == resident.stdout
