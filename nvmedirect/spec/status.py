"""NVMe completion status: one table from (status code type, status code) to a name, one retry
predicate, and the mapping to named exceptions.

Host-side outcomes (timeout, controller reset, queue closed) use status code type 8, outside the
3-bit field a device can report, so they travel the same completion path as device statuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from nvmedirect import errors

SCT_GENERIC = 0
SCT_COMMAND_SPECIFIC = 1
SCT_MEDIA = 2
SCT_PATH = 3
SCT_VENDOR = 7
SCT_HOST = 8  # not a device value: outcomes decided by this driver

SC_SUCCESS = 0x00
SC_HOST_TIMEOUT = 0x01
SC_HOST_CONTROLLER_RESET = 0x02
SC_HOST_QUEUE_CLOSED = 0x03

STATUS_NAMES: dict[tuple[int, int], str] = {
    (SCT_GENERIC, 0x00): "Successful Completion",
    (SCT_GENERIC, 0x01): "Invalid Command Opcode",
    (SCT_GENERIC, 0x02): "Invalid Field in Command",
    (SCT_GENERIC, 0x03): "Command ID Conflict",
    (SCT_GENERIC, 0x04): "Data Transfer Error",
    (SCT_GENERIC, 0x05): "Commands Aborted due to Power Loss Notification",
    (SCT_GENERIC, 0x06): "Internal Error",
    (SCT_GENERIC, 0x07): "Command Abort Requested",
    (SCT_GENERIC, 0x08): "Command Aborted due to SQ Deletion",
    (SCT_GENERIC, 0x09): "Command Aborted due to Failed Fused Command",
    (SCT_GENERIC, 0x0A): "Command Aborted due to Missing Fused Command",
    (SCT_GENERIC, 0x0B): "Invalid Namespace or Format",
    (SCT_GENERIC, 0x0C): "Command Sequence Error",
    (SCT_GENERIC, 0x0D): "Invalid SGL Segment Descriptor",
    (SCT_GENERIC, 0x0E): "Invalid Number of SGL Descriptors",
    (SCT_GENERIC, 0x0F): "Data SGL Length Invalid",
    (SCT_GENERIC, 0x10): "Metadata SGL Length Invalid",
    (SCT_GENERIC, 0x11): "SGL Descriptor Type Invalid",
    (SCT_GENERIC, 0x12): "Invalid Use of Controller Memory Buffer",
    (SCT_GENERIC, 0x13): "PRP Offset Invalid",
    (SCT_GENERIC, 0x14): "Atomic Write Unit Exceeded",
    (SCT_GENERIC, 0x15): "Operation Denied",
    (SCT_GENERIC, 0x16): "SGL Offset Invalid",
    (SCT_GENERIC, 0x18): "Host Identifier Inconsistent Format",
    (SCT_GENERIC, 0x19): "Keep Alive Timer Expired",
    (SCT_GENERIC, 0x1A): "Keep Alive Timeout Invalid",
    (SCT_GENERIC, 0x1B): "Command Aborted due to Preempt and Abort",
    (SCT_GENERIC, 0x1C): "Sanitize Failed",
    (SCT_GENERIC, 0x1D): "Sanitize In Progress",
    (SCT_GENERIC, 0x1E): "SGL Data Block Granularity Invalid",
    (SCT_GENERIC, 0x1F): "Command Not Supported for Queue in CMB",
    (SCT_GENERIC, 0x20): "Namespace is Write Protected",
    (SCT_GENERIC, 0x21): "Command Interrupted",
    (SCT_GENERIC, 0x22): "Transient Transport Error",
    (SCT_GENERIC, 0x80): "LBA Out of Range",
    (SCT_GENERIC, 0x81): "Capacity Exceeded",
    (SCT_GENERIC, 0x82): "Namespace Not Ready",
    (SCT_GENERIC, 0x83): "Reservation Conflict",
    (SCT_GENERIC, 0x84): "Format In Progress",
    (SCT_COMMAND_SPECIFIC, 0x00): "Completion Queue Invalid",
    (SCT_COMMAND_SPECIFIC, 0x01): "Invalid Queue Identifier",
    (SCT_COMMAND_SPECIFIC, 0x02): "Invalid Queue Size",
    (SCT_COMMAND_SPECIFIC, 0x03): "Abort Command Limit Exceeded",
    (SCT_COMMAND_SPECIFIC, 0x05): "Asynchronous Event Request Limit Exceeded",
    (SCT_COMMAND_SPECIFIC, 0x06): "Invalid Firmware Slot",
    (SCT_COMMAND_SPECIFIC, 0x07): "Invalid Firmware Image",
    (SCT_COMMAND_SPECIFIC, 0x08): "Invalid Interrupt Vector",
    (SCT_COMMAND_SPECIFIC, 0x09): "Invalid Log Page",
    (SCT_COMMAND_SPECIFIC, 0x0A): "Invalid Format",
    (SCT_COMMAND_SPECIFIC, 0x0B): "Firmware Activation Requires Conventional Reset",
    (SCT_COMMAND_SPECIFIC, 0x0C): "Invalid Queue Deletion",
    (SCT_COMMAND_SPECIFIC, 0x0D): "Feature Identifier Not Saveable",
    (SCT_COMMAND_SPECIFIC, 0x0E): "Feature Not Changeable",
    (SCT_COMMAND_SPECIFIC, 0x0F): "Feature Not Namespace Specific",
    (SCT_COMMAND_SPECIFIC, 0x10): "Firmware Activation Requires NVM Subsystem Reset",
    (SCT_COMMAND_SPECIFIC, 0x11): "Firmware Activation Requires Controller Level Reset",
    (SCT_COMMAND_SPECIFIC, 0x12): "Firmware Activation Requires Maximum Time Violation",
    (SCT_COMMAND_SPECIFIC, 0x13): "Firmware Activation Prohibited",
    (SCT_COMMAND_SPECIFIC, 0x14): "Overlapping Range",
    (SCT_COMMAND_SPECIFIC, 0x15): "Namespace Insufficient Capacity",
    (SCT_COMMAND_SPECIFIC, 0x16): "Namespace Identifier Unavailable",
    (SCT_COMMAND_SPECIFIC, 0x18): "Namespace Already Attached",
    (SCT_COMMAND_SPECIFIC, 0x19): "Namespace Is Private",
    (SCT_COMMAND_SPECIFIC, 0x1A): "Namespace Not Attached",
    (SCT_COMMAND_SPECIFIC, 0x1B): "Thin Provisioning Not Supported",
    (SCT_COMMAND_SPECIFIC, 0x1C): "Controller List Invalid",
    (SCT_COMMAND_SPECIFIC, 0x80): "Conflicting Attributes",
    (SCT_COMMAND_SPECIFIC, 0x81): "Invalid Protection Information",
    (SCT_COMMAND_SPECIFIC, 0x82): "Attempted Write to Read Only Range",
    (SCT_MEDIA, 0x80): "Write Fault",
    (SCT_MEDIA, 0x81): "Unrecovered Read Error",
    (SCT_MEDIA, 0x82): "End-to-end Guard Check Error",
    (SCT_MEDIA, 0x83): "End-to-end Application Tag Check Error",
    (SCT_MEDIA, 0x84): "End-to-end Reference Tag Check Error",
    (SCT_MEDIA, 0x85): "Compare Failure",
    (SCT_MEDIA, 0x86): "Access Denied",
    (SCT_MEDIA, 0x87): "Deallocated or Unwritten Logical Block",
    (SCT_PATH, 0x00): "Internal Path Error",
    (SCT_PATH, 0x60): "Controller Pathing Error",
    (SCT_PATH, 0x70): "Host Pathing Error",
    (SCT_PATH, 0x71): "Command Aborted By Host",
    (SCT_HOST, SC_HOST_TIMEOUT): "Command Timeout",
    (SCT_HOST, SC_HOST_CONTROLLER_RESET): "Aborted by Controller Reset",
    (SCT_HOST, SC_HOST_QUEUE_CLOSED): "Aborted: Queue Closed",
}

# Statuses with their own exception class; everything else falls back to one class per SCT.
_NAMED_EXCEPTIONS: dict[tuple[int, int], type[errors.NvmeStatusError]] = {
    (SCT_GENERIC, 0x01): errors.InvalidOpcode,
    (SCT_GENERIC, 0x02): errors.InvalidField,
    (SCT_GENERIC, 0x04): errors.DataTransferError,
    (SCT_GENERIC, 0x06): errors.InternalDeviceError,
    (SCT_GENERIC, 0x07): errors.CommandAborted,
    (SCT_GENERIC, 0x08): errors.CommandAborted,
    (SCT_GENERIC, 0x0B): errors.InvalidNamespace,
    (SCT_GENERIC, 0x80): errors.LbaOutOfRange,
    (SCT_MEDIA, 0x80): errors.WriteFault,
    (SCT_MEDIA, 0x81): errors.UnrecoveredReadError,
    (SCT_HOST, SC_HOST_TIMEOUT): errors.CommandTimeout,
    (SCT_HOST, SC_HOST_CONTROLLER_RESET): errors.ControllerFatal,
    (SCT_HOST, SC_HOST_QUEUE_CLOSED): errors.CommandAborted,
}
_BY_TYPE: dict[int, type[errors.NvmeStatusError]] = {
    SCT_GENERIC: errors.GenericStatusError,
    SCT_COMMAND_SPECIFIC: errors.CommandSpecificError,
    SCT_MEDIA: errors.MediaError,
    SCT_PATH: errors.PathError,
}


@dataclass(frozen=True)
class NvmeStatus:
    """A decoded completion status (the CQE's upper 15 bits, without the phase tag)."""

    sct: int
    sc: int
    dnr: bool = False  # Do Not Retry
    more: bool = False
    crd: int = 0  # Command Retry Delay selector

    @classmethod
    def from_cqe_status(cls, status_field: int) -> NvmeStatus:
        """Decode the CQE's 16-bit status field (bit 0 is the phase tag and is ignored)."""
        return cls(sct=(status_field >> 9) & 0x7, sc=(status_field >> 1) & 0xFF,
                   crd=(status_field >> 12) & 0x3, more=bool(status_field & 0x4000),
                   dnr=bool(status_field & 0x8000))

    @property
    def ok(self) -> bool:
        return self.sct == SCT_GENERIC and self.sc == SC_SUCCESS

    @property
    def name(self) -> str:
        if (self.sct, self.sc) in STATUS_NAMES:
            return STATUS_NAMES[(self.sct, self.sc)]
        if self.sct == SCT_VENDOR:
            return "Vendor Specific"
        return "Unknown Status"

    def is_retryable(self) -> bool:
        """Worth resubmitting: not success, DNR clear, and not a host-side outcome that a retry
        cannot change. Mirrors the rule every NVMe driver uses: only DNR forbids a retry."""
        if self.ok or self.dnr:
            return False
        if self.sct == SCT_HOST:
            return self.sc == SC_HOST_CONTROLLER_RESET
        return self.sct in (SCT_GENERIC, SCT_PATH, SCT_MEDIA, SCT_COMMAND_SPECIFIC)

    def exception_class(self) -> type[errors.NvmeStatusError]:
        return _NAMED_EXCEPTIONS.get((self.sct, self.sc)) or _BY_TYPE.get(self.sct, errors.NvmeStatusError)

    def exception(self, opcode: str = "", cid: int | None = None) -> errors.NvmeStatusError:
        return self.exception_class()(self, opcode=opcode, cid=cid)

    def __str__(self) -> str:
        dnr = " DNR" if self.dnr else ""
        return f"{self.sct:02x}/{self.sc:02x} {self.name}{dnr}"


SUCCESS = NvmeStatus(SCT_GENERIC, SC_SUCCESS)
HOST_TIMEOUT = NvmeStatus(SCT_HOST, SC_HOST_TIMEOUT, dnr=True)
HOST_CONTROLLER_RESET = NvmeStatus(SCT_HOST, SC_HOST_CONTROLLER_RESET)
HOST_QUEUE_CLOSED = NvmeStatus(SCT_HOST, SC_HOST_QUEUE_CLOSED, dnr=True)
