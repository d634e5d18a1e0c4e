"""write-gguf / ls-gguf on image files: placement, read-back through the reader, chain, refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from nvmedirect.cli import main
from nvmedirect.cli.common import EXIT_REFUSED, EXIT_USAGE
from nvmedirect.reader import ReadError, open_model


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def image(tmp_path: Path, size: int = 300 << 20, name: str = "dev.img") -> Path:
    path = tmp_path / name
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def assert_every_tensor_equal(model, gguf: Path) -> None:
    raw = np.fromfile(gguf, dtype=np.uint8)
    assert model.size == raw.nbytes
    for info in model.tensors.values():
        got = model.read_tensor(info.name)
        assert np.array_equal(got, raw[info.offset:info.offset + info.nbytes]), info.name


@pytest.mark.parametrize(("lba_size", "lba"), [(512, 0), (512, 12345), (4096, 0), (4096, 777)])
def test_write_then_read_every_tensor(tmp_path: Path, smollm2_path: Path, lba_size: int, lba: int) -> None:
    dev = image(tmp_path)
    result = run("write-gguf", str(smollm2_path), "-d", str(dev), "--lba", str(lba),
                 "--lba-size", str(lba_size), "--yes", "--json")
    assert result.exit_code == 0, result.output
    written = json.loads(result.output)
    assert written["start_lba"] == lba and written["lba_size"] == lba_size and written["verified"]
    header_lbas = max(4096, lba_size) // lba_size
    assert written["data_lba"] == lba + header_lbas
    # The GGUF really sits at data_lba on the raw image, byte for byte.
    raw = dev.read_bytes()
    start = written["data_lba"] * lba_size
    assert raw[start:start + written["gguf_bytes"]] == smollm2_path.read_bytes()
    with open_model(dev, lba=lba, lba_size=lba_size) as model:
        assert model.stored is not None and model.stored.model_name == smollm2_path.name
        assert_every_tensor_equal(model, smollm2_path)
        model.verify()


def test_chain_append_rewrite_and_confirmation(tmp_path: Path, smollm2_path: Path) -> None:
    dev = image(tmp_path)
    assert run("write-gguf", str(smollm2_path), "-d", str(dev), "--name", "first", "-y").exit_code == 0
    assert run("write-gguf", str(smollm2_path), "-d", str(dev), "--append", "--name", "second",
               "-y").exit_code == 0
    listing = json.loads(run("ls-gguf", "-d", str(dev), "--verify", "--json").output)
    assert [m["name"] for m in listing["models"]] == ["first", "second"]
    assert listing["models"][1]["start_lba"] == listing["models"][0]["next_lba"]
    assert all(m["verified"] for m in listing["models"])

    # A smaller model over the first: asks first, and "no" changes nothing.
    small = tmp_path / "small.gguf"
    small.write_bytes(make_small_gguf(tmp_path))
    before = dev.read_bytes()
    refused = run("write-gguf", str(small), "-d", str(dev), "--name", "tiny", input="n\n")
    assert refused.exit_code == 1 and "overwrites stored model 'first'" in refused.output
    assert dev.read_bytes() == before
    # "yes": the chain still reaches the second model behind the smaller one.
    assert run("write-gguf", str(small), "-d", str(dev), "--name", "tiny", input="y\n").exit_code == 0
    listing = json.loads(run("ls-gguf", "-d", str(dev), "--json").output)
    assert [m["name"] for m in listing["models"]] == ["tiny", "second"]
    with open_model(dev, name="second") as model:
        model.verify()
    with open_model(dev, name="tiny") as model:
        assert_every_tensor_equal(model, small)


def make_small_gguf(tmp_path: Path) -> bytes:
    from gguf import GGUFWriter

    path = tmp_path / "made.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("w", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def test_refuses_filesystem_signature_unless_forced(tmp_path: Path, smollm2_path: Path) -> None:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 not installed")
    dev = image(tmp_path)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(dev)], check=True, capture_output=True)
    before = dev.read_bytes()[:1 << 20]
    result = run("write-gguf", str(smollm2_path), "-d", str(dev), "--lba", "4096", "-y")
    assert result.exit_code == EXIT_REFUSED
    assert "ext2/3/4" in result.output and "--force" in result.output
    assert dev.read_bytes()[:1 << 20] == before
    forced = run("write-gguf", str(smollm2_path), "-d", str(dev), "--force", "-y")
    assert forced.exit_code == 0, forced.output


def test_bad_input(tmp_path: Path, smollm2_path: Path) -> None:
    small_dev = image(tmp_path, 50 << 20)
    too_big = run("write-gguf", str(smollm2_path), "-d", str(small_dev), "-y")
    assert too_big.exit_code == EXIT_USAGE and "does not fit" in too_big.output
    missing = run("write-gguf", str(smollm2_path), "-d", str(tmp_path / "nope"), "-y")
    assert missing.exit_code == EXIT_USAGE and "no such device" in missing.output
    both = run("write-gguf", str(smollm2_path), "-d", str(small_dev), "--lba", "1", "--append", "-y")
    assert both.exit_code == EXIT_USAGE


def test_corruption_is_reported(tmp_path: Path, smollm2_path: Path) -> None:
    dev = image(tmp_path)
    assert run("write-gguf", str(smollm2_path), "-d", str(dev), "-y").exit_code == 0
    with open(dev, "r+b") as f:  # flip one byte deep inside the tensor data
        f.seek(50 << 20)
        byte = f.read(1)
        f.seek(50 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    listing = run("ls-gguf", "-d", str(dev), "--verify", "--json")
    assert listing.exit_code == 1
    assert json.loads(listing.stdout)["models"][0]["verified"] is False
    with open_model(dev) as model, pytest.raises(ReadError, match="differs from the header"):
        model.verify()


def test_ls_on_an_empty_device(tmp_path: Path) -> None:
    dev = image(tmp_path, 4 << 20)
    result = run("ls-gguf", "-d", str(dev))
    assert result.exit_code == 0 and "no models stored" in result.output


def test_size_and_lba_range_are_checked_before_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nvmedirect.cli.gguf_store as gguf_store

    def no_hashing(*_args, **_kwargs):
        raise AssertionError("hashed a model that cannot be written")

    monkeypatch.setattr(gguf_store, "sha256_file", no_hashing)
    dev = image(tmp_path, 8 << 20)
    big = tmp_path / "big.gguf"
    with open(big, "wb") as f:  # sparse: the size is what matters
        f.truncate(64 << 20)
    too_big = run("write-gguf", str(big), "-d", str(dev), "-y")
    assert too_big.exit_code == EXIT_USAGE and "does not fit at LBA 0" in too_big.output
    small = tmp_path / "small.gguf"
    small.write_bytes(make_small_gguf(tmp_path))
    past_end = run("write-gguf", str(small), "-d", str(dev), "--lba", str(1 << 20), "-y")
    assert past_end.exit_code == EXIT_USAGE and "past the device's end" in past_end.output


def test_append_after_a_model_at_the_end_of_the_device_refuses_cleanly(tmp_path: Path) -> None:
    small = tmp_path / "small.gguf"
    small.write_bytes(make_small_gguf(tmp_path))
    dev = image(tmp_path, 7 << 19)  # 3.5 MiB: models start at each MiB, the fourth one's next LBA is past the end
    for index in range(4):
        written = run("write-gguf", str(small), "-d", str(dev), "--append", "--name", f"m{index}", "-y", "--json")
        assert written.exit_code == 0, written.output
    assert json.loads(written.output)["next_lba"] * 512 > 7 << 19
    appended = run("write-gguf", str(small), "-d", str(dev), "--append", "-y")
    assert appended.exit_code == EXIT_USAGE, appended.output
    assert "nothing can be appended" in appended.output and "'m3' at LBA 6144" in appended.output
    assert len(json.loads(run("ls-gguf", "-d", str(dev), "--json").output)["models"]) == 4
