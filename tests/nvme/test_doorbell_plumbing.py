"""The Python side of the GPU doorbell path (nvmedirect/gpu/doorbell.py: registration, device views,
the ring and work structs, statuses, ring state carried between drives) on a machine without a GPU.
A stand-in CuPy runs each "kernel" with its CPU twin over the very structs the launch was given
(device pointers are host pointers, as with unified addressing): nvd_drive_queues with the CPU
reference submitter, nvd_build_sqes with the CPU builder. The CUDA code itself runs in
tests/gpu/test_doorbell_gpu.py."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from nvmedirect.emulator import EmulatedController, ffi, library
from nvmedirect.gpu.rings import RING_DTYPE, QueueMemory, QueueSpec, host_build, random_reads
from nvmedirect.host_memory import address_of


class _Array(np.ndarray):
    """A NumPy array with CuPy's `.data.ptr` and `.get()`."""

    @property
    def data(self):  # CuPy's MemoryPointer, reduced to its address
        return types.SimpleNamespace(ptr=address_of(self))

    def get(self):
        return np.asarray(self).copy()


def _launch(name: str):
    lib = library()

    def drive(grid, block, args):
        rings, work, timeout_ns, _stray = args
        for k in range(grid[0]):
            ring = ffi.cast("struct nvd_ring *", address_of(rings) + k * RING_DTYPE.itemsize)
            lib.nvd_host_drive(ring, ffi.cast("struct nvd_work *", address_of(work)), int(timeout_ns))

    def build(grid, block, args):
        rings, work, out, errors = args
        rc = lib.nvd_host_build(ffi.cast("struct nvd_ring *", address_of(rings)),
                                ffi.cast("struct nvd_work *", address_of(work)),
                                ffi.cast("struct nvd_sqe *", address_of(out)))
        errors[0] += rc != 0

    def registers(grid, block, args):
        bar, out = args
        out[:] = np.frombuffer(ffi.buffer(ffi.cast("uint32_t *", int(bar)), 12), dtype=np.uint32)

    return {"nvd_drive_queues": drive, "nvd_build_sqes": build, "nvd_read_registers": registers}[name]


@pytest.fixture
def cpu_cupy(monkeypatch):
    registered: dict[int, int] = {}

    def host_register(address, nbytes, flags):
        assert address % 4096 == 0 and nbytes % 4096 == 0 and address not in registered
        registered[address] = nbytes

    runtime = types.SimpleNamespace(
        hostRegister=host_register, hostUnregister=lambda address: registered.pop(address),
        pointerGetAttributes=lambda address: types.SimpleNamespace(devicePointer=address))
    module = types.SimpleNamespace(compile=lambda: None, get_function=_launch)
    cupy = types.SimpleNamespace(
        asarray=lambda a: np.ascontiguousarray(a).view(_Array), asnumpy=lambda a: np.asarray(a).copy(),
        zeros=lambda n, dtype: np.zeros(n, dtype=dtype).view(_Array), uint8=np.uint8, uint32=np.uint32,
        int32=np.int32, RawModule=lambda **kw: module,
        cuda=types.SimpleNamespace(runtime=runtime,
                                   Device=lambda *a: types.SimpleNamespace(id=0, synchronize=lambda: None),
                                   compiler=types.SimpleNamespace(CompileException=RuntimeError)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    from nvmedirect.gpu import doorbell

    monkeypatch.setattr(doorbell, "module", lambda device_id=0: module)
    yield registered
    assert not registered, "GpuQueues.close() left memory registered"


@pytest.fixture
def emu(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 16 << 20, dtype=np.uint8)
    data.tofile(tmp_path / "ns.img")
    with EmulatedController(tmp_path / "ns.img", mdts_bytes=1 << 20) as controller:
        controller.set_idle_sleep(20e-6)
        yield controller, data


def test_gpu_queues_plumbing_drives_twice_and_keeps_the_ring_state(cpu_cupy, emu):
    from nvmedirect.gpu.doorbell import GpuQueues

    controller, data = emu
    work = random_reads(seed=11, count=3000, nsze=controller.nsze, lba_size=512, max_bytes=1 << 20)
    memory = QueueMemory(controller, [QueueSpec(1, 3, 7), QueueSpec(2, 100, 128)], work, 1 << 20)
    with GpuQueues(memory) as gpu:
        assert len(cpu_cupy) == len(memory.allocations) + 1  # every array and the BAR page
        for _ in range(2):
            memory.dst[:] = 0
            status = gpu.drive(timeout_s=5.0)
            assert not status.any()
            assert np.array_equal(memory.dst, work.expected(data))
        assert memory.state[0][0] == (2 * memory.queues[0]["count"]) % 7
        built, errors = gpu.build_sqes(1)
    assert errors == 0
    assert built.tobytes() == host_build(memory, 1)[0].tobytes()
    assert controller.violations == 0, controller.first_violation


def test_register_reader_reads_the_stand_in_bar(cpu_cupy, emu):
    from nvmedirect.gpu.doorbell import read_registers, register, unregister

    controller, _ = emu
    device = register(controller.bar_address, controller.bar_bytes)
    assert read_registers(device) == (controller.read_register(0, 8), controller.read_register(8))
    unregister(controller.bar_address)
