"""`--tier-c nvme --gpu-doorbells` on the H200 against the emulated controller (no machine has a GPU
and an NVMe drive): GpuDoorbellBackend's reads, issued by GPU threads through GpuQueues (SQEs
built on the GPU, doorbell words of the emulator's stand-in BAR0 written through a CUDA mapping),
every byte compared with the backing file; an injected NVMe status comes back as a ReadError in
the CPU path's form; and the streaming engine's tier C read through it computes the logits that
tier C read from the file computes.

Run there:  .venv/bin/python -m pytest -v tests/gpu/test_doorbell_reader_gpu.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from nvmedirect.emulator import EmulatedController
from nvmedirect.reader.base import ReadError
from nvmedirect.reader.gpu_doorbell_backend import GpuDoorbellBackend

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

IMAGE_BYTES = 64 << 20
MDTS = 1 << 20
CTX = 64


@pytest.fixture(scope="module")
def backing(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(1516).integers(0, 256, IMAGE_BYTES, dtype=np.uint8)
    path = tmp_path_factory.mktemp("doorbell-reader") / "namespace.img"
    data.tofile(path)
    return str(path), data


def _backend(emu: EmulatedController, **options) -> GpuDoorbellBackend:
    return GpuDoorbellBackend(emu, size_bytes=emu.nsze * emu.lba_size, lba_size=emu.lba_size, **options)


def test_gpu_initiated_reads_of_random_ranges_every_byte(backing) -> None:
    import cupyx

    path, data = backing
    rng = np.random.default_rng(7)
    with EmulatedController(path, mdts_bytes=MDTS) as emu, \
            _backend(emu, queue_depth=63, io_size=MDTS, batch_bytes=16 << 20) as backend:
        calls = 0
        for _ in range(40):  # 40 calls x 50 ranges; each call a fresh queue pair (ring from 0)
            sizes = np.where(rng.random(50) < 0.2, rng.integers(1, 3 << 20, 50), rng.integers(1, 64 << 10, 50))
            offsets = (rng.random(50) * (IMAGE_BYTES - sizes)).astype(np.int64)
            ranges = [(int(o), int(n)) for o, n in zip(offsets, sizes, strict=True)]
            # destinations as tier C's: CUDA-pinned staging (and plain pages for some)
            buffers = [cupyx.empty_pinned(n, np.uint8) if k % 2 else np.empty(n, np.uint8)
                       for k, (_, n) in enumerate(ranges)]
            backend.read_into(ranges, buffers)
            for (offset, nbytes), got in zip(ranges, buffers, strict=True):
                assert np.array_equal(np.asarray(got), data[offset:offset + nbytes]), (offset, nbytes)
            calls += 1
        counters, violations, first = emu.counters(), emu.violations, emu.first_violation
    assert calls == 40 and violations == 0, first
    assert counters["completed"] == counters["fetched"] > 2000
    assert counters["sq_doorbells"] < counters["fetched"]  # tail doorbells batched per round


def test_an_injected_status_is_a_read_error_as_the_cpu_path_raises(backing) -> None:
    path, _ = backing
    with EmulatedController(path, mdts_bytes=MDTS) as emu, _backend(emu, io_size=4096) as backend:
        emu.inject_status(7, 3, 2, 0x81)  # reads whose SLBA % 7 == 3: Unrecovered Read Error
        with pytest.raises(ReadError, match=r"failed: ERROR status: 02/81 .*GPU doorbells"):
            backend.read_into([(0, 1 << 20)], [np.empty(1 << 20, np.uint8)])
        emu.inject_status(0, 0, 0, 0)
        out = np.empty(1 << 20, np.uint8)
        backend.read_into([(0, 1 << 20)], [out])  # the next call reads fine
        assert emu.violations == 0, emu.first_violation


def test_streamed_tier_c_through_gpu_doorbells_equals_tier_c_from_the_file(tmp_path: Path, monkeypatch) -> None:
    """The engine's own tier C path (pinned staging buffers, StreamedWeights) over the emulator:
    the probe's positive answer is replaced by the emulator-backed backend, nothing else."""
    from infer import synth
    from infer.tiers import tier_c
    from infer.tiers.plan import Tier
    from infer.tiers.session import StreamingConfig, build_streaming_engine

    model = tmp_path / "m.gguf"
    synth.write_model(model, synth.Shape(n_layers=6, dim=512, ffn_dim=1536, n_heads=8, n_kv_heads=2,
                                         vocab_size=2000, context_length=256), "q4_k_m", seed=15)
    image = tmp_path / "namespace.img"  # the GGUF from LBA 0, padded to whole LBAs
    shutil.copyfile(model, image)
    with open(image, "r+b") as f:
        f.truncate(-(-image.stat().st_size // 4096) * 4096)
    emu = EmulatedController(image, mdts_bytes=MDTS).start()
    opened: list[GpuDoorbellBackend] = []

    def emulated(device: str, notes: list[str], options: dict) -> GpuDoorbellBackend:
        notes.append("tier C reads by GPU-initiated commands (emulated controller)")
        opened.append(_backend(emu, queue_depth=options.get("queue_depth", 63)))
        return opened[-1]

    monkeypatch.setattr(tier_c, "gpu_doorbell_backend", emulated)
    prompt = np.array([1, 5, 300, 7, 1000, 42])
    logits = {}
    try:
        for name, config in (("gpu doorbells", StreamingConfig(enabled=True, tier_c="nvme", nvme_device=str(image),
                                                                gpu_doorbells=True)),
                             ("file", StreamingConfig(enabled=True, tier_c="file"))):
            session = build_streaming_engine(str(model), config, CTX, device="gpu", measure=False)
            try:
                assert session.plan.bytes_in(Tier.STORAGE) > 0
                m = session.engine.model
                cache = m.new_cache(CTX)
                logits[name] = [m.forward(prompt, cache, all_logits=True), m.forward(np.array([9]), cache)]
            finally:
                session.close()
        counters, violations = emu.counters(), emu.violations
    finally:
        emu.close()
    assert len(opened) == 1 and counters["completed"] > 0 and violations == 0
    for got, want in zip(logits["gpu doorbells"], logits["file"], strict=True):
        np.testing.assert_array_equal(got, want)
