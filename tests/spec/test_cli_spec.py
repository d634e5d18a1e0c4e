"""`ntransformer --draft-model / --lookup` on the CPU: the text equals the plain run's (on the packed
native engine, the CPU's default, and with exact numerics: the two batch-invariant engines that
speculation on the CPU requires), the statistics are reported, and bad input is one line with
exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from infer import cpu_kernels
from infer.cli import main
from tests.oracle.assets import qwen05b_path, smollm2_path


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    target, draft = smollm2_path("Q8_0"), smollm2_path("Q4_0")
    if not (target.exists() and draft.exists()):
        pytest.skip("SmolLM2 Q8_0/Q4_0 missing: run scripts/fetch-models.sh")
    return target, draft


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--device", "cpu", "-c", "256", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("numerics", ["--exact", "packed"])
@pytest.mark.parametrize("how", [["--draft-model", "DRAFT"], ["--lookup"], ["--draft-model", "DRAFT", "--lookup"],
                                 ["--self-spec", "--draft-k", "3"], ["--skip-threshold", "0.9"]])
def test_speculative_text_is_the_plain_text(pair: tuple[Path, Path], how: list[str], numerics: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = pair
    if numerics == "packed":
        if not cpu_kernels.available():
            pytest.skip("the native CPU kernels are not built (scripts/bootstrap.sh builds them)")
        monkeypatch.delenv("NVMEDIRECT_CPU_PRODUCTS", raising=False)  # the default engine
    common = ["-m", str(target), "-p", "1, 2, 3, 4, 5, 6,", "-n", "20", "-t", "0",
              *(["--exact"] if numerics == "--exact" else [])]
    code, plain, _ = run(*common)
    assert code == 0
    code, spec, err = run(*common, *[str(draft) if a == "DRAFT" else a for a in how])
    assert code == 0, err
    assert spec == plain
    assert "tokens per pass" in err and "target passes" in err


@pytest.mark.skipif(not cpu_kernels.available(), reason="the native CPU kernels are not built")
@pytest.mark.parametrize("how", [["--lookup"], ["--self-spec", "--draft-k", "1"]])
def test_speculation_on_a_mixture_of_experts_is_the_plain_text(how: list[str], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A qwen3moe file on the packed engine (its experts packed too, batch-invariant): no --exact."""
    from infer.synth import SHAPES, write_model

    model = tmp_path / "qwen3moe-q8_0.gguf"
    write_model(model, SHAPES["tiny-moe"], "q8_0", seed=3)
    monkeypatch.delenv("NVMEDIRECT_CPU_PRODUCTS", raising=False)
    common = ["-m", str(model), "-p", "a b a b a b a b", "-n", "16", "-t", "0"]
    code, plain, err = run(*common)
    assert code == 0, err
    code, spec, err = run(*common, *how)
    assert code == 0, err
    assert spec == plain and "target passes" in err


def test_speculative_json_reports_the_statistics(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    code, out, err = run("-m", str(target), "--draft-model", str(draft), "--draft-tree", "5", "--benchmark",
                         "-n", "16", "--json", "--exact")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    s = record["speculation"]
    assert record["tree_nodes"] == 5 and s["generated_tokens"] == 16 and s["passes"] >= 1
    assert s["tokens_per_pass"] == round(16 / s["passes"], 3) and s["verify_seconds"] > 0


def test_bad_speculation_input_is_one_line_and_exit_2(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    other = qwen05b_path()
    cases = [["--draft-tree", "0", "--lookup"], ["--lookup", "--batch", "2"], ["--lookup", "--chat"],
             ["--draft-model", str(draft), "--self-spec"], ["--lookup", "--skip-threshold", "0.9"],
             ["--draft-k", "3"], ["--skip-threshold", "0"], ["--skip-threshold", "1.5"],
             ["--skip-text", str(target), "--self-spec"], ["--self-spec", "--draft-k", "0"]]
    if other.exists():
        cases.append(["--draft-model", str(other)])  # 151936 tokens against SmolLM2's 49152
    cases.append(["--draft-model", str(target.with_name("missing.gguf"))])
    for extra in cases:
        code, out, err = run("-m", str(target), "-p", "hi", "-n", "2", *extra)
        lines = [line for line in (err + out).splitlines() if line.startswith("Error")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (extra, out, err)


def test_self_draft_reports_its_layers(pair: tuple[Path, Path]) -> None:
    """--skip-threshold says which layers the calibration left out; a threshold no layer reaches
    leaves none out, a low one leaves out many (never all)."""
    target, _ = pair
    common = ["-m", str(target), "-p", "def add(a, b):", "-n", "8", "-t", "0", "--exact"]
    code, _, err = run(*common, "--skip-threshold", "0.999999")
    assert code == 0, err
    assert "self-draft: 30 of 30 layers (left out: none" in err
    code, _, err = run(*common, "--skip-threshold", "0.05")
    assert code == 0, err
    line = next(x for x in err.splitlines() if "self-draft:" in x)
    kept = int(line.split("self-draft: ")[1].split(" of ")[0])
    assert 1 <= kept < 30, line


def test_self_spec_on_the_streamed_cpu_engine_leaves_the_streamed_layers_out(pair: tuple[Path, Path]) -> None:
    """--streaming with a RAM budget that streams some layers: the self-draft keeps only the wholly
    resident ones, and the text is the plain streamed run's."""
    target, _ = pair
    common = ["-m", str(target), "-p", "1, 2, 3, 4, 5,", "-n", "12", "-t", "0", "--streaming",
              "--vram-budget", "140MB", "--ram-budget", "1GB", "--exact"]
    code, plain, err0 = run(*common)
    assert code == 0, err0
    code, spec, err = run(*common, "--self-spec")
    assert code == 0, err
    assert spec == plain
    line = next(x for x in err.splitlines() if "self-draft:" in x)
    kept = int(line.split("self-draft: ")[1].split(" of ")[0])
    assert 1 <= kept < 30, line


@pytest.mark.parametrize("how", [["--lookup"], ["--draft-model", "DRAFT"], ["--self-spec"]])
def test_speculation_on_the_cpu_without_exact_is_refused(pair: tuple[Path, Path], how: list[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: on the NumPy float32 engine a speculative run's text drifted from plain decoding (4 of
    20 prompts identical with --lookup); it is refused with one line naming the engines that work."""
    monkeypatch.setenv("NVMEDIRECT_CPU_PRODUCTS", "numpy")
    target, draft = pair
    code, out, err = run("-m", str(target), "-p", "hi", "-n", "4", "-t", "0",
                         *[str(draft) if a == "DRAFT" else a for a in how])
    lines = [line for line in (err + out).splitlines() if line.startswith("Error")]
    assert code == 2 and out == "", (code, out, err)
    assert lines == ["Error: speculative decoding on the CPU needs an engine whose logits do not depend on how many "
                     "tokens a pass holds, or the text would differ from plain decoding: the packed native engine (the "
                     "default where the native kernels are built; not --streaming, files with a matrix type the "
                     "kernels do not take, or NVMEDIRECT_CPU_PRODUCTS=numpy) or --exact"]


@pytest.mark.oracle
def test_gemma3_speculation_is_the_plain_text_and_a_foreign_draft_is_refused() -> None:
    """Gemma 3 under prompt lookup and under a layer-skipping self-draft (its local and global layers,
    post-norms and GeGLU in the draft too) gives the plain greedy text; SmolLM2 as its draft is refused
    for its other vocabulary."""
    from tests.oracle.fixtures import model_path

    gemma = model_path("gemma3")
    common = ["-m", str(gemma), "-p", "1, 2, 3, 4, 5, 6, 7, 8,", "-n", "12", "-t", "0", "--exact"]
    code, plain, err = run(*common)
    assert code == 0, err
    for how in (["--lookup"], ["--skip-threshold", "0.9"]):
        code, spec, err = run(*common, *how)
        assert code == 0, err
        assert spec == plain, how
    smollm2 = smollm2_path("Q8_0")
    if smollm2.exists():
        code, out, err = run("-m", str(gemma), "-p", "hi", "-n", "2", "--exact", "--draft-model", str(smollm2))
        lines = [line for line in (err + out).splitlines() if line.startswith("Error")]
        assert code == 2 and len(lines) == 1 and "vocab" in lines[0].lower(), (out, err)


def test_speculation_turns_the_cpu_tier_off_unless_asked() -> None:
    """A speculative streamed run on the GPU keeps the CPU tier off by default (a small tree the CPU
    computed could change the text), says so, and keeps an explicit --cpu-tier."""
    import click

    from infer.cli_spec import _speculation_cpu_tier
    from infer.tiers.config import StreamingConfig

    @click.command()
    @click.option("--cpu-tier", default="auto")
    @click.option("--device", default="gpu")
    def cmd(cpu_tier: str, device: str) -> None:
        click.echo(_speculation_cpu_tier(StreamingConfig(enabled=True, cpu_tier=cpu_tier), device).cpu_tier)

    default = CliRunner().invoke(cmd, [])
    assert default.exit_code == 0 and default.stdout.strip() == "off"
    assert "speculation: --cpu-tier off" in default.stderr
    for given in ("auto", "3"):
        kept = CliRunner().invoke(cmd, ["--cpu-tier", given])
        assert kept.stdout.strip() == given and "speculation" not in kept.stderr
    assert CliRunner().invoke(cmd, ["--device", "cpu"]).stdout.strip() == "auto"  # the CPU engine has no tier
