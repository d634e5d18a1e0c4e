"""Tier C from a GGUF written to raw LBAs (`nvmedirect write-gguf` onto an image file, found by its
header through nvmedirect's reader): streamed logits equal resident ones, and a device holding a
different model is refused. The userspace-driver path is the same reader over NvmeBackend (VM tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.synth import SHAPES, Shape, write_model
from infer.tiers.plan import Tier
from infer.tiers.session import StreamingConfig, build_streaming_engine
from nvmedirect.cli import main as nvmedirect_main

CTX = 64


def write_to_image(model: Path, image: Path, lba: int) -> None:
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    result = CliRunner().invoke(nvmedirect_main, ["write-gguf", str(model), "-d", str(image), "--lba", str(lba),
                                                  "--yes", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_tier_c_from_a_model_on_raw_lbas(tiny_model: Path, tmp_path: Path) -> None:
    image = tmp_path / "nvme.img"
    write_to_image(tiny_model, image, lba=777)
    config = StreamingConfig(enabled=True, tier_c="nvme", nvme_device=str(image), nvme_lba=777)
    session = build_streaming_engine(str(tiny_model), config, CTX, device="cpu", measure=False)
    try:
        assert session.plan.bytes_in(Tier.STORAGE) > 0
        assert "staged read (nvme)" in set(session.paths.values())
        tokens = np.array([1, 5, 300, 7, 1000])
        got = session.engine.model.forward(tokens, session.engine.model.new_cache(CTX), all_logits=True)
    finally:
        session.close()
    reference = load_transformer(GGUFModel(tiny_model))
    np.testing.assert_array_equal(got, reference.forward(tokens, reference.new_cache(CTX), all_logits=True))


def test_a_device_holding_another_model_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    write_model(other, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 4}), "q8_0", seed=3)
    image = tmp_path / "nvme.img"
    write_to_image(other, image, lba=0)
    config = StreamingConfig(enabled=True, tier_c="nvme", nvme_device=str(image))
    with pytest.raises(ValueError, match="differs from the GGUF being run"):
        build_streaming_engine(str(tiny_model), config, CTX, device="cpu", measure=False)
    with pytest.raises(ValueError, match="needs the device"):
        build_streaming_engine(str(tiny_model), StreamingConfig(enabled=True, tier_c="nvme"), CTX, device="cpu",
                               measure=False)
