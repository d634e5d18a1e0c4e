"""FileBackend: random unaligned ranges into unaligned destinations, many in flight, equal the file."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from nvmedirect.host_memory import address_of
from nvmedirect.reader import DirectIOUnsupported, FileBackend, ReadError, aligned_empty

SIZE = (24 << 20) + 1234  # the file does not end on a block boundary


def o_direct_supported(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    os.close(fd)
    return True


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("fb") / "data.bin"
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    data.tofile(path)
    return path, data


def random_ranges(rng: np.random.Generator, count: int, size: int) -> list[tuple[int, int]]:
    ranges = []
    for _ in range(count):
        nbytes = int(rng.choice([1, 7, 511, 4096, 4097, 65535, 1 << 20, (3 << 20) + 5, 8 << 20]))
        offset = int(rng.integers(0, size - nbytes + 1))
        ranges.append((offset, nbytes))
    return ranges


@pytest.mark.parametrize(("queue_depth", "io_size"), [(1, 4 << 20), (16, 64 << 10), (4, 1 << 20)])
def test_random_ranges_many_in_flight(data_file, queue_depth: int, io_size: int) -> None:
    path, data = data_file
    rng = np.random.default_rng(queue_depth)
    ranges = random_ranges(rng, 200, SIZE)
    # Destinations start at odd addresses inside one bytearray, so the staging path is exercised too.
    arena = bytearray(sum(n + 3 for _, n in ranges))
    views, at = [], 3
    for _, nbytes in ranges:
        views.append(memoryview(arena)[at:at + nbytes])
        at += nbytes + 3
    with FileBackend(path, queue_depth=queue_depth, io_size=io_size) as backend:
        assert backend.direct == o_direct_supported(path)
        handle = backend.read_async(ranges, views)  # every range submitted before any wait
        handle.wait()
    for (offset, nbytes), view in zip(ranges, views, strict=True):
        assert bytes(view) == data[offset:offset + nbytes].tobytes(), (offset, nbytes)


def test_aligned_zero_copy_path_and_file_end(data_file) -> None:
    path, data = data_file
    with FileBackend(path, queue_depth=4, io_size=1 << 20) as backend:
        dest = aligned_empty(SIZE)
        assert address_of(dest) % 4096 == 0
        backend.read_into([(0, SIZE)], [dest])
        assert np.array_equal(dest, data)
        tail = backend.read_bytes(SIZE - 10, 10)
        assert tail == data[-10:].tobytes()


def test_several_handles_outstanding(data_file) -> None:
    path, data = data_file
    with FileBackend(path, queue_depth=8, io_size=256 << 10) as backend:
        outs = [np.empty(1 << 20, dtype=np.uint8) for _ in range(12)]
        handles = [backend.read_async([(i * (1 << 20) + 17, 1 << 20)], [outs[i]]) for i in range(12)]
        for i in reversed(range(12)):
            handles[i].wait()
            assert np.array_equal(outs[i], data[i * (1 << 20) + 17:(i + 1) * (1 << 20) + 17])


def test_bad_requests(data_file) -> None:
    path, _ = data_file
    with FileBackend(path) as backend:
        with pytest.raises(ReadError, match="outside"):
            backend.read_async([(SIZE - 5, 10)], [bytearray(10)])
        with pytest.raises(ReadError, match="cannot hold"):
            backend.read_async([(0, 10)], [bytearray(5)])
        with pytest.raises(ReadError, match="read-only"):
            backend.read_async([(0, 10)], [bytes(10)])
        with pytest.raises(ReadError, match="2 ranges but 1"):
            backend.read_async([(0, 1), (1, 1)], [bytearray(2)])
    with pytest.raises(ReadError, match="cannot open"):
        FileBackend(path.parent / "missing.bin")


def test_tmpfs_falls_back_to_buffered_reads_with_a_warning() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    path = shm / f"nvmedirect-test-{os.getpid()}.bin"
    data = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8)
    data.tofile(path)
    try:
        if o_direct_supported(path):
            pytest.skip("this kernel's tmpfs supports O_DIRECT (6.6+): no fallback to test")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend = FileBackend(path, queue_depth=4, io_size=1 << 20)
        assert any(issubclass(w.category, DirectIOUnsupported) for w in caught)
        with backend:
            assert not backend.direct
            out = bytearray(100_001)
            backend.read_into([(12345, 100_001)], [out])
            assert bytes(out) == data[12345:12345 + 100_001].tobytes()
    finally:
        path.unlink()


def test_open_refusing_o_direct_falls_back(data_file, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fallback, forced: a filesystem whose open() rejects O_DIRECT with EINVAL."""
    path, data = data_file
    real_open = os.open

    def open_without_direct(name, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(name, flags, *args)

    monkeypatch.setattr("nvmedirect.reader.file_backend.os.open", open_without_direct)
    with pytest.warns(DirectIOUnsupported, match="page cache"), FileBackend(path) as backend:
        assert not backend.direct
        out = np.empty(5000, dtype=np.uint8)
        backend.read_into([(SIZE - 5000, 5000)], [out])
        assert np.array_equal(out, data[-5000:])
