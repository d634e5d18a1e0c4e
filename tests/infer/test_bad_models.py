"""Bad model files: each gives one line naming the file and the tensor or key at fault, and exit
code 2 from the CLI (never a traceback). The files are small synthetic models, then damaged."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader, GGUFValueType

from infer import cpu_kernels
from infer.cli import main
from infer.errors import ModelError
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.synth import Shape, write_model
from tests.oracle.gguf_edit import write_copy

TINY = Shape(n_layers=2, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=128)


@pytest.fixture(scope="module")
def good_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_model(path, TINY, "q8_0", seed=1)
    return path


@pytest.fixture
def model_copy(good_model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copy(good_model, tmp_path / "damaged.gguf"))


def run_cli(path: Path) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["-m", str(path), "-p", "hello", "-n", "2", "-t", "0"])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(path: Path, *fragments: str) -> str:
    code, stdout, stderr = run_cli(path)
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and stdout == ""
    for fragment in (str(path), *fragments):
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def patch_tensor_field(path: Path, tensor_name: str, part: int, value: int) -> None:
    """Overwrites one field of a tensor's info record in place (part 4 = type id, 5 = data offset)."""
    reader = GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == tensor_name)
    tensor.field.parts[part][0] = value
    reader.data.flush()
    del reader


def test_the_undamaged_model_runs(good_model: Path) -> None:
    code, stdout, _ = run_cli(good_model)
    assert code == 0 and stdout.strip() != ""


def test_missing_file(tmp_path: Path) -> None:
    assert_one_line_error(tmp_path / "nope.gguf", "no such file")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_one_line_error(path, "not a GGUF file")


def test_file_truncated_in_the_tensor_data(model_copy: Path) -> None:
    size = model_copy.stat().st_size
    with open(model_copy, "r+b") as f:
        f.truncate(size - 1000)
    assert_one_line_error(model_copy, "tensor ", "outside the file")


def test_file_truncated_in_the_header(model_copy: Path) -> None:
    with open(model_copy, "r+b") as f:
        f.truncate(200)
    assert_one_line_error(model_copy, "truncated")


def test_corrupt_tensor_offset(model_copy: Path) -> None:
    patch_tensor_field(model_copy, "blk.1.ffn_up.weight", 5, 1 << 40)
    assert_one_line_error(model_copy, "tensor blk.1.ffn_up.weight", "outside the file")


def test_misaligned_tensor_offset(model_copy: Path) -> None:
    patch_tensor_field(model_copy, "blk.0.attn_q.weight", 5, 3)
    assert_one_line_error(model_copy, "tensor blk.0.attn_q.weight", "not aligned")


def test_unknown_tensor_type_id(model_copy: Path) -> None:
    patch_tensor_field(model_copy, "blk.0.ffn_down.weight", 4, 99)
    assert_one_line_error(model_copy, "tensor blk.0.ffn_down.weight", "unknown tensor type id 99")


def test_unsupported_architecture(good_model: Path, tmp_path: Path) -> None:
    path = write_copy(good_model, tmp_path / "gpt.gguf", metadata={"general.architecture": ("gptneox", GGUFValueType.STRING)})
    assert_one_line_error(path, "key general.architecture", "architecture 'gptneox' is not supported")


def test_a_tensor_no_engine_reads_is_refused(good_model: Path, tmp_path: Path) -> None:
    """A file whose tensors include one the forward pass would skip (here a shared expert's gate, as
    Qwen2-MoE files carry) would compute something else than it says: one line naming the tensor,
    as llama.cpp refuses such a file (its count of tensors does not match)."""
    extra = {"blk.0.ffn_gate_inp_shexp.weight": np.ones(64, np.float32)}
    path = write_copy(good_model, tmp_path / "extra.gguf", extra_tensors=extra)
    assert_one_line_error(path, "tensor blk.0.ffn_gate_inp_shexp.weight", "1 tensor(s) that no engine here computes with",
                          "not supported")


def test_missing_metadata_key(good_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "nokey.gguf"
    reader_keys = GGUFModel(good_model).metadata
    assert "llama.embedding_length" in reader_keys
    _copy_without_key(good_model, path, "llama.embedding_length")
    assert_one_line_error(path, "key llama.embedding_length", "missing")


def test_missing_tensor(good_model: Path, tmp_path: Path) -> None:
    path = write_copy(good_model, tmp_path / "notensor.gguf", drop_tensors=("blk.1.attn_k.weight",))
    assert_one_line_error(path, "tensor blk.1.attn_k.weight", "missing")


def test_tensor_shape_disagreeing_with_metadata(good_model: Path, tmp_path: Path) -> None:
    path = write_copy(good_model, tmp_path / "wide.gguf", metadata={"llama.feed_forward_length": (256, GGUFValueType.UINT32)})
    assert_one_line_error(path, "tensor blk.0.ffn_gate.weight", "shape")


def test_the_api_raises_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such file"):
        load_transformer(GGUFModel(tmp_path / "nope.gguf"))


def _copy_without_key(source: Path, target: Path, key: str) -> None:
    # write_copy replaces keys; to drop one, copy then rewrite with the key renamed out of the way
    write_copy(source, target, metadata={key: (0, GGUFValueType.UINT32)})
    data = bytearray(target.read_bytes())
    at = data.find(key.encode())
    data[at : at + len(key)] = key.replace("embedding", "embeddinX").encode()
    target.write_bytes(bytes(data))


def test_tokenizer_error_names_the_file(good_model: Path, tmp_path: Path) -> None:
    path = write_copy(good_model, tmp_path / "badtok.gguf", metadata={"tokenizer.ggml.model": ("bogus", GGUFValueType.STRING)})
    assert_one_line_error(path, "tokenizer", "unsupported tokenizer model")


@pytest.mark.parametrize("engine", ["numpy", "native"])
def test_nan_weights_end_in_one_line_naming_the_model(model_copy: Path, engine: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The NumPy engine finds the NaN in the logits; the packed one in the output product's input."""
    if engine == "native" and not cpu_kernels.available():
        pytest.skip("the native CPU kernels are not built (scripts/bootstrap.sh builds them)")
    monkeypatch.setenv("NVMEDIRECT_CPU_PRODUCTS", engine)
    reader = GGUFReader(model_copy, "r+")
    norm = next(t for t in reader.tensors if t.name == "output_norm.weight")
    norm.data[...] = np.nan
    reader.data.flush()
    del reader
    code, stdout, stderr = run_cli(model_copy)
    assert code == 2 and stdout == "" and "Traceback" not in stderr, (code, stderr)
    last = stderr.strip().splitlines()[-1]  # after the "loaded ..." note
    what = "non-finite logits" if engine == "numpy" else "non-finite activations"
    assert str(model_copy) in last and what in last and "NaN" in last, last


def _untyped_unknown_token(source: Path, target: Path, arch: str, unk: int) -> Path:
    """A copy whose 'llama' (sentencepiece) vocabulary types no token UNKNOWN but names one with
    tokenizer.ggml.unknown_token_id, as Gemma 3's GGUFs do."""
    types = [int(t) for t in GGUFModel(source).metadata["tokenizer.ggml.token_type"]]
    types = [1 if t == 2 else t for t in types]  # UNKNOWN -> NORMAL
    return write_copy(source, target, metadata={
        "general.architecture": (arch, GGUFValueType.STRING),
        "tokenizer.ggml.token_type": (types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        "tokenizer.ggml.unknown_token_id": (unk, GGUFValueType.UINT32)})


def test_an_unsupported_architecture_is_named_before_the_tokenizer(good_model: Path, tmp_path: Path) -> None:
    """Issue 29: Gemma 3 gave "'llama' tokenizer without an unknown token" because the tokenizer
    was built before the architecture was checked (Gemma 3 loads now; Gemma 2 files look the same)."""
    path = _untyped_unknown_token(good_model, tmp_path / "gemma2ish.gguf", "gemma2", 3)
    line = assert_one_line_error(path, "architecture 'gemma2' is not supported")
    assert "tokenizer" not in line


def test_a_named_unknown_token_is_the_unknown_token(good_model: Path, tmp_path: Path) -> None:
    from infer.tokenizer import Tokenizer
    from infer.tokenizer.vocab import TokenType

    path = _untyped_unknown_token(good_model, tmp_path / "unk0.gguf", "llama", 0)  # "<unk>", typed NORMAL
    tokenizer = Tokenizer.from_gguf(GGUFModel(path).metadata)
    assert tokenizer.vocab.unk_id == 0 and tokenizer.vocab.types[0] == TokenType.UNKNOWN
    assert tokenizer.encode("hello world")  # sentencepiece accepts the vocabulary
    code, stdout, _ = run_cli(path)
    assert code == 0 and stdout.strip()


@pytest.mark.parametrize("size", [4, 24, 100, 5000])
def test_a_file_cut_inside_its_header_says_truncated_gguf_header(model_copy: Path, size: int) -> None:
    """Issue 29: a GGUF cut to 100 bytes gave NumPy's own message about dtypes in its one line."""
    with open(model_copy, "r+b") as f:
        f.truncate(size)
    line = assert_one_line_error(model_copy, "truncated GGUF header", f"ends at byte {size}")
    assert "dtype" not in line and "array" not in line


def test_a_rope_factor_without_a_type_is_linear_scaling(good_model: Path, tmp_path: Path) -> None:
    """Issue 29: `rope.scaling.factor = 4` without `rope.scaling.type` was silently ignored (the
    output equal to the original's). llama.cpp reads a missing type as linear: so does this engine,
    and so the copy generates what the copy with `type = linear` generates."""
    from infer.arch import ModelArgs

    factor = {"llama.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32)}
    untyped = write_copy(good_model, tmp_path / "factor-only.gguf", metadata=factor)
    linear = write_copy(good_model, tmp_path / "linear.gguf", metadata={
        **factor, "llama.rope.scaling.type": ("linear", GGUFValueType.STRING)})
    none = write_copy(good_model, tmp_path / "none.gguf", metadata={
        **factor, "llama.rope.scaling.type": ("none", GGUFValueType.STRING)})
    old_key = write_copy(good_model, tmp_path / "old-key.gguf", metadata={
        "llama.rope.scale_linear": (4.0, GGUFValueType.FLOAT32)})
    assert ModelArgs.from_gguf(GGUFModel(untyped)).rope_linear_scale == 4.0
    assert ModelArgs.from_gguf(GGUFModel(old_key)).rope_linear_scale == 4.0
    assert ModelArgs.from_gguf(GGUFModel(none)).rope_linear_scale == 1.0  # "none" never scales (llama.cpp too)

    def logits(path: Path) -> np.ndarray:
        from infer.engine import Engine

        model = load_transformer(GGUFModel(path), exact=True)
        return Engine(model, 64).evaluate([1, *range(260, 290)], all_logits=True)

    original, scaled = logits(good_model), logits(untyped)
    np.testing.assert_array_equal(scaled, logits(linear))
    assert not np.array_equal(scaled, original)


def test_rope_scaling_llama_cpp_would_not_apply_is_refused_with_its_key(good_model: Path, tmp_path: Path) -> None:
    """Linear and YaRN scaling and the attention factor are honoured (checked against llama.cpp in
    test_oracle_architectures.py); any other type, or YaRN parameters llama.cpp does not read for
    this architecture, stop with the key named rather than being ignored."""
    from infer.arch import ModelArgs

    longrope = write_copy(good_model, tmp_path / "longrope.gguf", metadata={
        "llama.rope.scaling.type": ("longrope", GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32)})
    assert_one_line_error(longrope, "key llama.rope.scaling.type", "rope scaling 'longrope' is not supported")
    beta = write_copy(good_model, tmp_path / "beta.gguf", metadata={
        "llama.rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
        "llama.rope.scaling.yarn_beta_fast": (16.0, GGUFValueType.FLOAT32)})
    assert_one_line_error(beta, "key llama.rope.scaling.yarn_beta_fast", "16 is not supported")
    factor = write_copy(good_model, tmp_path / "attn-factor.gguf", metadata={
        "llama.rope.scaling.attn_factor": (1.2, GGUFValueType.FLOAT32)})
    scaling = ModelArgs.from_gguf(GGUFModel(factor)).rope_scaling
    assert (scaling.kind, scaling.attn_factor) == ("none", pytest.approx(1.2))


def test_logit_softcapping_is_refused_not_ignored(tmp_path: Path) -> None:
    """A Gemma 3 file that sets final_logit_softcapping (llama.cpp applies it) is refused with the key
    named, rather than run without it; 0 (no capping) loads."""
    gemma = tmp_path / "gemma3.gguf"
    write_model(gemma, Shape(**{**TINY.__dict__, "head_dim": 64}), "f16", seed=1, arch="gemma3")
    capped = write_copy(gemma, tmp_path / "capped.gguf",
                        metadata={"gemma3.final_logit_softcapping": (30.0, GGUFValueType.FLOAT32)})
    assert_one_line_error(capped, "key gemma3.final_logit_softcapping", "soft-capping (30.0) is not supported")
    zero = write_copy(gemma, tmp_path / "zero.gguf", metadata={"gemma3.final_logit_softcapping": (0.0, GGUFValueType.FLOAT32)})
    code, stdout, err = run_cli(zero)
    assert code == 0 and stdout.strip(), err


MOE = Shape(**{**TINY.__dict__, "arch": "qwen3moe", "head_dim": 16, "n_experts": 4, "n_experts_used": 2,
               "expert_ffn_dim": 64})


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "moe.gguf"
    write_model(path, MOE, "q8_0", seed=1)
    return path


def test_a_mixture_of_experts_file_runs_and_its_faults_are_named(moe_model: Path, tmp_path: Path) -> None:
    """A qwen3moe file runs; a missing expert stack, a stack whose shape the expert keys contradict,
    and expert counts llama.cpp would refuse each stop with one line naming the tensor or key."""
    code, stdout, err = run_cli(moe_model)
    assert code == 0 and stdout.strip(), err
    missing = write_copy(moe_model, tmp_path / "no-up.gguf", drop_tensors=("blk.1.ffn_up_exps.weight",))
    assert_one_line_error(missing, "tensor blk.1.ffn_up_exps.weight", "required tensor is missing")
    no_router = write_copy(moe_model, tmp_path / "no-router.gguf", drop_tensors=("blk.0.ffn_gate_inp.weight",))
    assert_one_line_error(no_router, "tensor blk.0.ffn_gate_inp.weight", "required tensor is missing")
    wider = write_copy(moe_model, tmp_path / "wider.gguf",
                       metadata={"qwen3moe.expert_feed_forward_length": (128, GGUFValueType.UINT32)})
    assert_one_line_error(wider, "tensor blk.0.ffn_gate_exps.weight", "shape [4, 64, 64] where [4, 128, 64]")
    more = write_copy(moe_model, tmp_path / "more.gguf", metadata={"qwen3moe.expert_count": (8, GGUFValueType.UINT32)})
    assert_one_line_error(more, "tensor blk.0.ffn_gate_inp.weight", "shape")
    greedy = write_copy(moe_model, tmp_path / "used.gguf",
                        metadata={"qwen3moe.expert_used_count": (5, GGUFValueType.UINT32)})
    assert_one_line_error(greedy, "key qwen3moe.expert_used_count", "5 experts per token do not fit 1..4")
    none = write_copy(moe_model, tmp_path / "none.gguf", metadata={"qwen3moe.expert_count": (0, GGUFValueType.UINT32)})
    assert_one_line_error(none, "key qwen3moe.expert_count", "qwen3moe needs experts")


def test_expert_gating_llama_cpp_would_not_apply_is_refused_with_its_key(moe_model: Path, tmp_path: Path) -> None:
    """llama.cpp routes qwen3moe and Mixtral files by softmax with normalised weights whatever these
    keys say; a file that asks for other gating is refused rather than run another way."""
    sigmoid = write_copy(moe_model, tmp_path / "sigmoid.gguf",
                         metadata={"qwen3moe.expert_gating_func": (2, GGUFValueType.UINT32)})
    assert_one_line_error(sigmoid, "key qwen3moe.expert_gating_func", "expert gating 2 is not supported")
    raw = write_copy(moe_model, tmp_path / "raw.gguf", metadata={"qwen3moe.expert_weights_norm": (False, GGUFValueType.BOOL)})
    assert_one_line_error(raw, "key qwen3moe.expert_weights_norm", "unnormalised expert weights")
    per_layer = write_copy(moe_model, tmp_path / "per-layer.gguf", metadata={
        "qwen3moe.expert_used_count": ([2, 1], GGUFValueType.ARRAY, GGUFValueType.UINT32)})
    assert_one_line_error(per_layer, "key qwen3moe.expert_used_count", "per-layer values [2, 1] are not supported")


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infer.synth import SHAPES

    path = tmp_path_factory.mktemp("models") / "gpt-oss.gguf"
    write_model(path, SHAPES["tiny-gpt-oss"], "q8_0", seed=1)
    return path


def test_a_gpt_oss_file_runs_on_the_cpu_and_its_faults_are_named(gpt_oss_model: Path, tmp_path: Path) -> None:
    """A gpt-oss file runs on the CPU engine (--streaming too: its experts tiered); a missing sink or
    expert bias, a missing sliding window and a rotary base of the local layers' own each stop with
    one line naming the tensor or key."""
    code, stdout, err = run_cli(gpt_oss_model)
    assert code == 0 and stdout.strip(), err
    for name in ("blk.1.attn_sinks.weight", "blk.0.ffn_down_exps.bias", "blk.0.attn_output.bias"):
        missing = write_copy(gpt_oss_model, tmp_path / f"no-{name}.gguf", drop_tensors=(name,))
        assert_one_line_error(missing, f"tensor {name}", "required tensor is missing")
    no_window = write_copy(gpt_oss_model, tmp_path / "no-window.gguf", drop_keys=("gpt-oss.attention.sliding_window",))
    assert_one_line_error(no_window, "key gpt-oss.attention.sliding_window", "needs its sliding window")
    base = write_copy(gpt_oss_model, tmp_path / "base.gguf",
                      metadata={"gpt-oss.rope.freq_base_swa": (10000.0, GGUFValueType.FLOAT32)})
    assert_one_line_error(base, "key gpt-oss.rope.freq_base_swa", "not supported")
    streamed = CliRunner().invoke(main, ["-m", str(gpt_oss_model), "-p", "hello", "-n", "2", "-t", "0", "--streaming",
                                         "--ram-budget", "1MB"])
    assert streamed.exit_code == 0 and streamed.stdout == stdout, streamed.stderr
