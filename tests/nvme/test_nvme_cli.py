"""`nvmedirect identify`: argument checks, exit codes, and the human printer over the fake controller."""

from __future__ import annotations

from click.testing import CliRunner

from nvmedirect.cli import main
from nvmedirect.cli.common import EXIT_NOT_READY, EXIT_USAGE
from nvmedirect.cli.identify import describe, print_identify


def test_bad_address_is_a_usage_error():
    result = CliRunner().invoke(main, ["identify", "not-a-bdf"])
    assert result.exit_code == EXIT_USAGE
    assert "is not a PCI address" in result.output


def test_absent_device_is_not_ready():
    # No such PCI device (or no VFIO at all on this machine): either way, not ready.
    result = CliRunner().invoke(main, ["identify", "0000:fe:1f.7", "--json"])
    assert result.exit_code == EXIT_NOT_READY, result.output


def test_describe_and_print(ctrl, capsys):
    data = describe(ctrl, "0000:01:00.0")
    assert data["controller"]["serial"] == "FAKE0001"
    assert data["namespaces"][0]["lba_size"] == 512 and data["max_transfer_bytes"] == 128 << 10
    print_identify(data)
    out = capsys.readouterr().out
    assert "model     nvmedirect fake" in out and "serial    FAKE0001" in out
    assert "nsid 1: 8192 blocks of 512 B" in out and "LBA formats: 512*, 4096" in out


def test_the_mode_is_the_one_in_use_not_the_flag(fake):
    """Issue 29: in a no-IOMMU VM, `identify BDF` (no --noiommu flag: the mode comes from the
    device's group) printed "(IOMMU)". The mode reported is the one the controller's DMA runs in."""
    from fake_nvme import FakeBar, IdentityDma

    from nvmedirect.nvme.controller import Controller

    class PhysicalDma(IdentityDma):  # what NoIommuDma says of itself
        physical = True

    for dma, mode in ((IdentityDma(), "IOMMU"), (PhysicalDma(), "no-IOMMU")):
        controller = Controller(FakeBar(fake), dma, io_timeout_s=1.0)
        controller.start(io_queues=1)
        try:
            data = describe(controller, "0000:01:00.0")
        finally:
            controller.close()
        assert data["mode"] == mode
        print_identify(data)
