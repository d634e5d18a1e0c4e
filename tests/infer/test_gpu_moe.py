"""A mixture-of-experts model resident on the GPU, its experts either in VRAM and computed there
(infer.gpu.experts.GpuExperts) or left in RAM for the CPU (infer.tiers.cpu_tier.CpuExperts), on the
NumPy stand-in for CuPy (tests/fake_cupy.py) with the native CPU kernels: the experts take device
memory only in the first placement, the logits follow the CPU engine within the GPU-vs-CPU bound,
a row's logits do not depend on the pass it rides in, and the device's decode loop gives the host
loop's tokens. tests/gpu/test_moe_gpu.py runs the same on a real GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer import cpu_kernels
from infer.arch import EXPERT_BLOCK_KINDS
from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.synth import Shape, write_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the native CPU kernels are not built")

QWEN3MOE = Shape(n_layers=3, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, vocab_size=600, context_length=512,
                 rope_base=1e6, norm_eps=1e-6, arch="qwen3moe", head_dim=64, n_experts=8, n_experts_used=3,
                 expert_ffn_dim=256)
QWEN2MOE = Shape(n_layers=3, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, vocab_size=600, context_length=512,
                 rope_base=1e6, norm_eps=1e-6, arch="qwen2moe", n_experts=8, n_experts_used=2, expert_ffn_dim=256,
                 shared_ffn_dim=512)
CTX = 128


FILES = [("qwen3moe", "f16"), ("qwen3moe", "q8_0"), ("qwen3moe", "q4_k_m"), ("qwen2moe", "q8_0")]


def write_moe(directory: Path, arch: str, kind: str) -> Path:
    path = directory / f"{arch}-{kind}.gguf"
    if not path.exists():
        write_model(path, QWEN3MOE if arch == "qwen3moe" else QWEN2MOE, kind, seed=11)
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpumoe")


@pytest.fixture(params=FILES, ids=lambda p: "-".join(p))
def moe_path(request: pytest.FixtureRequest, moe_dir: Path) -> Path:
    return write_moe(moe_dir, *request.param)


@pytest.fixture(params=FILES[1:], ids=lambda p: "-".join(p))
def quantized_moe(request: pytest.FixtureRequest, moe_dir: Path) -> Path:
    return write_moe(moe_dir, *request.param)


@pytest.fixture(params=["cpu", "gpu", 1], ids=lambda p: f"experts-{p}")
def place(request: pytest.FixtureRequest) -> str | int:
    """Where the experts go: "cpu" (RAM, computed by the CPU), "gpu" (VRAM, computed there) or 1
    (block 0's on the CPU, the others' in VRAM)."""
    return request.param


def placed(moe_path: Path, place: str | int) -> str | int:
    """The placement a test of this file runs: a float file's experts have no GPU product."""
    if place != "cpu" and "f16" in moe_path.name:
        pytest.skip("the GPU multiplies experts in quantized formats only (a float file's stay with the CPU)")
    return place


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_logits_follow_the_cpu(moe_path: Path, place: str | int, fake_cupy: object) -> None:
    check_follows_the_cpu(moe_path, placed(moe_path, place))


def test_a_row_does_not_depend_on_its_pass(moe_path: Path, place: str | int, fake_cupy: object) -> None:
    check_pass_independence(moe_path, placed(moe_path, place))


def check_follows_the_cpu(moe_path: Path, place: str | int) -> None:
    """The experts take device memory only when placed there ("experts" in the plan); the logits
    follow the packed CPU engine's."""
    from infer.gpu import experts as on_gpu
    from infer.gpu import load_gpu_transformer
    from infer.tiers.plan import planner_tensors

    model = GGUFModel(moe_path)
    gpu = load_gpu_transformer(model, CTX, experts=place)
    n = gpu.args.n_layers
    on_cpu = list(range(n)) if place == "cpu" else [] if place == "gpu" else list(range(int(place)))
    assert (gpu.cpu_experts.layers if gpu.cpu_experts else []) == on_cpu
    assert sorted(gpu.gpu_experts.blocks if gpu.gpu_experts else []) == [i for i in range(n) if i not in on_cpu]
    planned = planner_tensors(model, "gpu")
    experts = [t for t in planned if t.kind in EXPERT_BLOCK_KINDS]
    assert experts and all(t.device_nbytes == 0 for t in experts)
    assert gpu.account is not None and gpu.account.planned["weights"] == sum(t.device_nbytes for t in planned)
    if place != "cpu":
        assert gpu.gpu_experts.nbytes == sum(on_gpu.block_bytes(model, i) for i in gpu.gpu_experts.blocks)
        rounding = on_gpu.BUFFER_ROUNDING * on_gpu.MATRICES_PER_BLOCK * len(gpu.gpu_experts.blocks)
        assert gpu.account.planned["experts"] == gpu.gpu_experts.nbytes + rounding
        assert gpu.account.planned["expert buffers"] >= on_gpu.buffers_nbytes(model, gpu.args, gpu.capacity) > 0
        # the blocks whose experts are in VRAM replay in the pass's graphs; the CPU's run op by op
        assert [i for capturable, items in gpu._segments if not capturable for i in items] == on_cpu
    else:
        assert "experts" not in gpu.account.planned
    for L in gpu.layers:
        assert L.ffn_gate is L.ffn_up is L.ffn_down is None and len(L.matrices()) == 4
    prompt = np.random.default_rng(1).integers(3, 600, 9)
    steps = [5, 77, 401, 12]
    cache = gpu.new_cache(CTX)
    got = [gpu.forward(prompt, cache, all_logits=True)] + [gpu.forward(np.array([t]), cache) for t in steps]
    cpu = load_transformer(GGUFModel(moe_path), packed=True)
    cache = cpu.new_cache(CTX)
    want = [cpu.forward(prompt, cache, all_logits=True)] + [cpu.forward(np.array([t]), cache) for t in steps]
    g2, w2 = np.concatenate([g.reshape(-1, 600) for g in got]), np.concatenate([w.reshape(-1, 600) for w in want])
    errors = np.array([rel(g, w) for g, w in zip(g2, w2, strict=True)])
    if "f16" in moe_path.name:  # float products on both sides: no 8-bit rounding lands apart, no route flips
        assert errors.max() < 1e-3, errors
        return
    # 8-bit inputs: the GPU tests' bound between the engines; a row whose rounding lands one unit
    # apart can route a token to another expert in some block, which moves that row further
    assert np.mean(errors < 3e-2) >= 0.75 and np.median(errors) < 3e-2, errors
    assert np.mean(g2.argmax(-1) == w2.argmax(-1)) >= 0.75


def check_pass_independence(moe_path: Path, place: str | int) -> None:
    """A prompt in one pass, token by token, and beside another sequence: the same bits (a pass of
    one row multiplies each (row, expert) pair alone, one of 6 or 40 groups the pairs by expert
    first); the device's decode loop gives the host loop's greedy tokens."""
    from infer.gpu import load_gpu_transformer

    gpu = load_gpu_transformer(GGUFModel(moe_path), CTX, batch=2, experts=place)
    k = gpu.args.n_experts_used
    if gpu.gpu_experts is not None:
        assert not gpu.gpu_experts.group_tiles(k) and gpu.gpu_experts.group_tiles(8 * k)
    for tokens in (np.array([1, 17, 300, 42, 599, 8]), np.random.default_rng(2).integers(3, 600, 40)):
        whole = gpu.forward(tokens, gpu.new_cache(CTX), all_logits=True)
        cache = gpu.new_cache(CTX)
        one_by_one = np.stack([gpu.forward(np.array([t]), cache) for t in tokens])
        np.testing.assert_array_equal(whole, one_by_one)
    other = gpu.new_cache(CTX)
    gpu.forward(np.array([9, 10, 11]), other)
    alone = gpu.new_cache(CTX)
    gpu.forward(tokens[:-1], alone)
    beside = gpu.new_cache(CTX)
    gpu.forward(tokens[:-1], beside)
    want = gpu.forward(tokens[-1:], alone)
    got = gpu.forward_batch([(tokens[-1:], beside), (np.array([12]), other)])
    np.testing.assert_array_equal(got[0].reshape(-1), want.reshape(-1))
    prompt = tokens[:4]
    on_device = list(gpu.generate(prompt, gpu.new_cache(CTX), 6))
    cache = gpu.new_cache(CTX)
    logits, host = gpu.forward(prompt, cache, prompt=True), []  # prompt rows, as generate prefills
    for _ in range(6):
        host.append(int(np.argmax(logits.reshape(-1))))
        logits = gpu.forward(np.array(host[-1:]), cache)
    assert on_device == host


def test_the_cli_runs_a_mixture_of_experts_on_the_gpu(moe_dir: Path, fake_cupy: object) -> None:
    """`ntransformer --device gpu` on a MoE file generates (the CPU engine's greedy text for the
    float file); with --streaming: tests/infer/test_gpu_moe_tiered.py."""
    from click.testing import CliRunner

    from infer.cli import main

    moe_path = write_moe(moe_dir, "qwen3moe", "f16")
    args = ["-m", str(moe_path), "-p", "hello there", "-n", "6", "-t", "0", "--json"]
    gpu = CliRunner().invoke(main, [*args, "--device", "gpu"])
    assert gpu.exit_code == 0, gpu.output
    assert "experts: " in gpu.stderr and "stay in RAM" in gpu.stderr and "the CPU computes" in gpu.stderr
    assert "not in VRAM: its expert stacks are f16" in gpu.stderr
    tight = CliRunner().invoke(main, [*args, "--device", "gpu", "--vram-budget", "1MB"])
    assert tight.exit_code == 2 and "run on the CPU (--device cpu)" in tight.output and "--streaming" not in tight.output
    cpu = CliRunner().invoke(main, [*args, "--device", "cpu"])
    assert cpu.exit_code == 0, cpu.output
    import json

    assert json.loads(gpu.stdout)["ids"] == json.loads(cpu.stdout)["ids"]


def test_the_cli_places_the_experts(moe_dir: Path, fake_cupy: object) -> None:
    """A quantized file's experts go to VRAM when they fit (the load report says so), to the CPU
    with --cpu-moe or when the budget leaves no room for them, split by blocks when it leaves room
    for some or with --n-cpu-moe N (the first N on the CPU); the CPU's runs give the same text."""
    import json

    from click.testing import CliRunner

    from infer.cli import main

    moe_path = write_moe(moe_dir, "qwen3moe", "q8_0")
    args = ["-m", str(moe_path), "-p", "hello there", "-n", "6", "-t", "0", "--json", "--device", "gpu"]
    # the plan without experts takes 669 MiB here; the experts' buffers 8.4 MiB, a block's experts
    # 1.6 MiB, and an upload's transient 64 MiB stay free: 675 MiB holds no block, 744 MiB one
    # (the staging to stream the other two, 2.2 MiB, would cost more than a quarter of that block)
    runs = {name: CliRunner().invoke(main, [*args, *extra]) for name, extra in
            (("vram", []), ("asked", ["--cpu-moe"]), ("tight", ["--vram-budget", "675MiB"]),
             ("split", ["--vram-budget", "744MiB"]), ("first", ["--n-cpu-moe", "2"]))}
    for run in runs.values():
        assert run.exit_code == 0, run.output
    assert "every block's in VRAM" in runs["vram"].stderr and "stay in RAM" not in runs["vram"].stderr
    assert "not in VRAM: asked for (--cpu-moe)" in runs["asked"].stderr
    assert "do not fit the" in runs["tight"].stderr and "the VRAM budget leaves" in runs["tight"].stderr
    split = runs["split"].stderr
    assert "the experts of 1 of 3 blocks (2) in VRAM" in split, split
    assert "the feed-forward of 2 of 3 blocks (0-1)" in split and "room for the experts of 1 of 3 blocks" in split
    first = runs["first"].stderr
    assert "the experts of 1 of 3 blocks (2) in VRAM" in first and "asked for (--n-cpu-moe 2)" in first, first
    ids = {name: json.loads(run.stdout)["ids"] for name, run in runs.items()}
    assert ids["asked"] == ids["tight"]
    assert ids["split"] == ids["first"] and all(len(v) == 6 for v in ids.values())
    both = CliRunner().invoke(main, [*args, "--cpu-moe", "--n-cpu-moe", "1"])
    assert both.exit_code == 2 and "cannot be combined" in both.output
    assert "stream to the GPU for passes of >= 16 prompt rows" in first  # auto: the CPU's blocks stream
    off = CliRunner().invoke(main, [*args, "--n-cpu-moe", "2", "--expert-stream", "off"])
    assert off.exit_code == 0 and "stream to the GPU" not in off.stderr and json.loads(off.stdout)["ids"] == ids["first"]
    bad = CliRunner().invoke(main, [*args, "--n-cpu-moe", "2", "--expert-stream", "sometimes"])
    assert bad.exit_code == 2 and "--expert-stream takes auto, off or a count of prompt rows" in bad.output


def test_the_experts_see_no_null_row(moe_dir: Path, place: str | int, fake_cupy: object,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass of 3 sequences is padded to a bucket of 4 rows; the experts see the 3 real ones (on
    the GPU the null row is routed to no expert: ids -1)."""
    from infer.gpu import load_gpu_transformer
    from infer.moe import MixtureOfExperts

    moe_path = write_moe(moe_dir, "qwen3moe", "q8_0")
    gpu = load_gpu_transformer(GGUFModel(moe_path), CTX, batch=4, experts=place)
    caches = [gpu.new_cache(CTX) for _ in range(3)]
    for k, c in enumerate(caches):
        gpu.forward(np.array([3 + k, 4, 5]), c)
    seen: list[int] = []
    call = MixtureOfExperts.__call__

    def spy(self: MixtureOfExperts, h: np.ndarray, *args: object, **kwargs: object) -> np.ndarray:
        seen.append(len(h))
        return call(self, h, *args, **kwargs)

    monkeypatch.setattr(MixtureOfExperts, "__call__", spy)
    gpu.forward_batch([(np.array([7]), c) for c in caches])
    from infer.gpu.passes import bucket_of

    assert bucket_of(3, gpu.capacity) == 4  # the pass had a null row
    assert gpu.index.live_rows.tolist() == [0, 1, 2]
    on_cpu = QWEN3MOE.n_layers if place == "cpu" else 0 if place == "gpu" else int(place)
    assert seen == [3] * on_cpu
    if place == "cpu":
        return
    k = QWEN3MOE.n_experts_used
    ids = cupy_host(gpu.gpu_experts.ids)[: 4 * k].reshape(4, k)
    assert (ids[:3] >= 0).all() and (ids[3] == -1).all()


def cupy_host(a: object) -> np.ndarray:
    import cupy

    return cupy.asnumpy(a)


def test_speculation_on_the_gpu_moe_is_plain_decoding(quantized_moe: Path, place: str | int,
                                                     fake_cupy: object) -> None:
    """A mixture of experts on the GPU as the target of greedy speculation (its tree passes run the
    experts of every node, on the CPU or the GPU): the text of plain decoding, with a draft that
    agrees (the target itself) and with one that does not (a dense model of the same vocabulary)."""
    from infer.gpu import load_gpu_transformer
    from infer.speculative import ModelDrafter, Speculator

    moe_path = quantized_moe
    target = load_gpu_transformer(GGUFModel(moe_path), CTX, tree_nodes=9, experts=place)
    dense = moe_path.with_name(f"dense-{moe_path.name}")
    if not dense.exists():
        write_model(dense, Shape(n_layers=2, dim=128, ffn_dim=256, n_heads=2, n_kv_heads=1, vocab_size=600,
                                 context_length=512), "q8_0", seed=5)
    prompt = [5, 17, 300, 42]
    want = list(target.generate(np.array(prompt), target.new_cache(CTX), 12))
    for draft in (target, load_gpu_transformer(GGUFModel(dense), CTX)):
        spec = Speculator(target, ModelDrafter(draft, CTX, 4, 2), 9, CTX)
        assert list(spec.generate(list(prompt), 12, greedy)) == want
        assert spec.stats.passes > 0


def test_placement_refusals_and_edges(moe_dir: Path, fake_cupy: object) -> None:
    """Placements that cannot be are one-line errors; --n-cpu-moe beyond the blocks is every block
    on the CPU; a float file's experts asked onto the GPU are refused, and left to the CPU otherwise."""
    from infer.errors import UnsupportedModelError
    from infer.gpu import load_gpu_transformer

    model = GGUFModel(write_moe(moe_dir, "qwen3moe", "q8_0"))
    with pytest.raises(ValueError, match="or a count of blocks, not 'vram'"):
        load_gpu_transformer(model, CTX, experts="vram")
    with pytest.raises(ValueError, match="count of blocks, not -1"):
        load_gpu_transformer(model, CTX, experts=-1)
    every = load_gpu_transformer(model, CTX, experts=99, expert_stream="off")
    assert every.gpu_experts is None and every.cpu_experts.layers == [0, 1, 2]
    streamed = load_gpu_transformer(model, CTX, experts=99)  # nothing in VRAM, long prompts streamed
    assert streamed.gpu_experts.blocks == {} and streamed.gpu_experts.stream.layers == [0, 1, 2]
    with pytest.raises(ValueError, match="auto, off or a count of prompt rows, not 'on'"):
        load_gpu_transformer(model, CTX, experts=1, expert_stream="on")
    assert "asked for (--n-cpu-moe 99)" in every.cpu_experts.describe()
    floats = GGUFModel(write_moe(moe_dir, "qwen3moe", "f16"))
    with pytest.raises(UnsupportedModelError, match="quantized formats only"):
        load_gpu_transformer(floats, CTX, experts="gpu")
    split = load_gpu_transformer(floats, CTX, experts=1)
    assert split.gpu_experts is None and "expert stacks are f16" in split.cpu_experts.describe()
    # more routed experts a token than the GPU's router keeps (a lane each): the CPU computes them
    from dataclasses import replace

    from infer.gpu.experts import ROUTE_MAX_K, stacks_on_device

    wide = replace(every.args, n_experts_used=ROUTE_MAX_K + 1)
    assert f"it routes {ROUTE_MAX_K + 1} experts a token" in (stacks_on_device(model, wide) or "")
    assert stacks_on_device(model, every.args) is None


@pytest.mark.parametrize("place", ["cpu", 1], ids=lambda p: f"experts-{p}")
def test_long_prompts_stream_the_cpus_experts(moe_dir: Path, place: str | int, fake_cupy: object) -> None:
    check_streaming(moe_dir, place)


def check_streaming(moe_dir: Path, place: str | int) -> None:
    """Blocks the CPU computes stream their experts to the GPU for a pass of many prompt rows
    (infer.gpu.expert_stream): the prompt's KV cache then holds the bits of a run with every expert
    in VRAM (the same grouped products), each stack crossed the link once a block, a short prompt
    stays with the CPU, and "off" streams nothing."""
    from infer.arch import tensor_name
    from infer.gpu import load_gpu_transformer
    from infer.gpu.expert_stream import min_prompt_rows

    model = GGUFModel(write_moe(moe_dir, "qwen3moe", "q4_k_m"))
    gpu = load_gpu_transformer(model, CTX, experts=place)
    stream = gpu.gpu_experts.stream
    on_cpu = [0, 1, 2] if place == "cpu" else [0]
    assert stream is not None and stream.layers == on_cpu and stream.min_rows == min_prompt_rows(gpu.args) == 16
    assert gpu.account.planned["expert stream"] == stream.nbytes > 0
    assert "stream to the GPU for passes of >= 16 prompt rows" in gpu.gpu_experts.describe()
    tokens = np.random.default_rng(5).integers(3, 600, 40)
    short = gpu.new_cache(CTX)
    gpu.prefill_batch([(tokens[:15], short)])
    assert stream.streamed_bytes == 0
    cache = gpu.new_cache(CTX)
    gpu.prefill_batch([(tokens, cache)])
    stacks = sum(model.tensor(tensor_name(i, k)).nbytes for i in on_cpu for k in ("ffn_gate_exps", "ffn_up_exps",
                                                                                   "ffn_down_exps"))
    assert stream.streamed_bytes == stacks
    resident = load_gpu_transformer(model, CTX, experts="gpu")
    want = resident.new_cache(CTX)
    resident.prefill_batch([(tokens, want)])
    for got_group, want_group in ((cache.full, want.full), (cache.ring, want.ring)):
        np.testing.assert_array_equal(cupy_host(got_group.keys), cupy_host(want_group.keys))
        np.testing.assert_array_equal(cupy_host(got_group.values), cupy_host(want_group.values))
    # a prompt whose last row is canonical: that row stays with the CPU, the others stream, in one pass
    mixed, whole = gpu.new_cache(CTX), resident.new_cache(CTX)
    got = gpu.forward(tokens, mixed, prompt=True)
    resident.forward(tokens, whole, prompt=True)
    assert stream.streamed_bytes == 2 * stacks
    last = len(tokens) - 1
    np.testing.assert_array_equal(cupy_host(mixed.full.keys)[:, :, :last], cupy_host(whole.full.keys)[:, :, :last])
    np.testing.assert_array_equal(cupy_host(mixed.full.values)[:, :, :last], cupy_host(whole.full.values)[:, :, :last])
    off = load_gpu_transformer(model, CTX, experts=place, expert_stream="off")
    assert off.gpu_experts is None or off.gpu_experts.stream is None
    # the canonical row was computed (by the CPU): the logits follow the unstreamed run's (its prompt
    # rows the CPU's), here within 0.93% on the stand-in
    want = off.forward(tokens, off.new_cache(CTX), prompt=True)
    assert rel(got, want) < 3e-2 and got.argmax() == want.argmax()


def test_refused_page_locking_leaves_the_cpus_blocks_unstreamed(moe_dir: Path, fake_cupy: object,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import cupy

    from infer.gpu import load_gpu_transformer

    def refuse(*args: object) -> None:
        raise cupy.cuda.runtime.CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    monkeypatch.setattr("infer.tiers.tier_b.gpu_present", lambda: True)
    monkeypatch.setattr(cupy.cuda.runtime, "hostRegister", refuse)
    model = GGUFModel(write_moe(moe_dir, "qwen3moe", "q4_k_m"))
    gpu = load_gpu_transformer(model, CTX, experts="cpu")
    assert gpu.gpu_experts is None and "page-locking their pages failed" in gpu.cpu_experts.describe()
    split = load_gpu_transformer(model, CTX, experts=1)
    assert split.gpu_experts.stream is None and sorted(split.gpu_experts.blocks) == [1, 2]
    tokens = np.array([3, 9, 27])
    np.testing.assert_array_equal(split.forward(tokens, split.new_cache(CTX)),
                                  load_gpu_transformer(model, CTX, experts=1, expert_stream="off").forward(
                                      tokens, split.new_cache(CTX)))


@pytest.mark.parametrize("slots", [1, 3])
def test_the_cpus_blocks_share_their_picks_with_the_gpu(moe_dir: Path, slots: int, fake_cupy: object,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVMEDIRECT_EXPERT_GPU_SLOTS", str(slots))
    check_split(moe_dir, slots)


def check_split(moe_dir: Path, slots: int) -> None:
    """A block the CPU holds splits each row's picks (infer.gpu.expert_split, NVMEDIRECT_EXPERT_GPU_SLOTS
    set by the caller): the first `slots` computed on the GPU from experts fetched over the link,
    the rest by the CPU. A row's logits still do not depend on its pass and follow the CPU engine;
    with every pick on the GPU a decode step is bit for bit the run with every expert in VRAM."""
    from infer.gpu import load_gpu_transformer

    path = write_moe(moe_dir, "qwen3moe", "q4_k_m")
    gpu = load_gpu_transformer(GGUFModel(path), CTX, experts=1)
    assert gpu.gpu_experts.split.slots == slots and "NVMEDIRECT_EXPERT_GPU_SLOTS" in gpu.gpu_experts.describe()
    check_pass_independence(path, 1)
    check_follows_the_cpu(path, 1)
    tokens = [5, 77, 401, 12, 9]
    cache = gpu.new_cache(CTX)
    got = np.stack([gpu.forward(np.array([t]), cache) for t in tokens])
    assert gpu.gpu_experts.stream.streamed_bytes > 0  # the picks' experts crossed the link
    if slots == gpu.args.n_experts_used:
        resident = load_gpu_transformer(GGUFModel(path), CTX, experts="gpu")
        cache = resident.new_cache(CTX)
        np.testing.assert_array_equal(got, np.stack([resident.forward(np.array([t]), cache) for t in tokens]))
        # a long prompt: its prompt rows streamed while the last (canonical) row is split, in one pass
        prompt = np.random.default_rng(3).integers(3, 600, 40)
        before = gpu.gpu_experts.stream.streamed_bytes
        mixed = gpu.forward(prompt, gpu.new_cache(CTX), prompt=True)
        assert gpu.gpu_experts.stream.streamed_bytes > before
        np.testing.assert_array_equal(mixed, resident.forward(prompt, resident.new_cache(CTX), prompt=True))


def test_a_split_across_gpus_places_each_stages_experts(quantized_moe: Path, place: str | int,
                                                         fake_cupy: object) -> None:
    check_stages(quantized_moe, place)


def check_stages(quantized_moe: Path, place: str | int) -> None:
    """A mixture of experts in stages (infer.gpu.stages, --gpus; both on one device): each stage
    places its own blocks' experts (--n-cpu-moe 1: block 0's on the CPU, in the first stage) and
    every row's logits are the one-GPU engine's with the same placement."""
    from infer.gpu import load_gpu_transformer
    from infer.gpu.stages import CopyLink, PipelineTransformer

    model = GGUFModel(quantized_moe)
    whole = load_gpu_transformer(model, CTX, "10GB", experts=place)
    stages = [load_gpu_transformer(model, CTX, "10GB", experts=place, layers=r) for r in (range(0, 1), range(1, 3))]
    staged = PipelineTransformer(stages, CopyLink())
    on_cpu = {i for s in stages if s.cpu_experts is not None for i in s.cpu_experts.layers}
    assert on_cpu == {"cpu": {0, 1, 2}, "gpu": set(), 1: {0}}[place]
    prompt = np.array([1, 5, 9, 14, 3, 7, 11, 2, 8, 4])
    for m in (whole, staged):
        cache = m.new_cache(CTX)
        m.rows = [m.forward(prompt, cache, all_logits=True), m.forward(np.array([12]), cache)]  # type: ignore[attr-defined]
    for e, g in zip(whole.rows, staged.rows, strict=True):  # type: ignore[attr-defined]
        assert np.array_equal(e, g)


def test_the_cli_splits_a_mixture_of_experts_across_gpus(moe_dir: Path, fake_cupy: object) -> None:
    """`--gpus 0 --n-cpu-moe 1`: the one GPU's tokens, its stage's experts placed as asked."""
    import json

    from click.testing import CliRunner

    from infer.cli import main

    args = ["-m", str(write_moe(moe_dir, "qwen3moe", "q8_0")), "-p", "hello there", "-n", "6", "-t", "0", "--json",
            "--n-cpu-moe", "1", "--vram-budget", "10GB"]
    staged = CliRunner().invoke(main, [*args, "--gpus", "0"])
    whole = CliRunner().invoke(main, [*args, "--device", "gpu"])
    assert staged.exit_code == 0 and whole.exit_code == 0, staged.output + whole.output
    assert json.loads(staged.stdout)["ids"] == json.loads(whole.stdout)["ids"]
    assert "asked for (--n-cpu-moe 1)" in staged.stderr


def test_the_cpus_decode_share_is_timed_against_the_ram(moe_dir: Path, fake_cupy: object) -> None:
    """The CPU's blocks time their one-row calls (a decode step's) and count what a token makes them
    read: each block's router and shared expert, and the routed experts' share of its stacks;
    bench.gpu_bench sets that against the RAM's read bandwidth measured in the same run."""
    from bench.gpu_bench import cpu_share
    from infer.gpu import load_gpu_transformer

    path = write_moe(moe_dir, "qwen2moe", "q8_0")
    model = GGUFModel(path)
    gpu = load_gpu_transformer(model, CTX, experts=1)
    cpu, a = gpu.cpu_experts, gpu.args
    assert cpu is not None and cpu.layers == [0]

    def nbytes(kind: str) -> int:
        return model.tensor(f"blk.0.{kind}.weight").nbytes

    routed = sum(nbytes(f"ffn_{m}_exps") for m in ("gate", "up", "down")) * a.n_experts_used // a.n_experts
    shared = sum(nbytes(k) for k in ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"))
    assert cpu.row_bytes() == nbytes("ffn_gate_inp") + routed + shared
    cache = gpu.new_cache(CTX)
    gpu.forward(np.array([1, 17, 300]), cache)  # a prompt pass: not a decode row
    assert cpu.row_calls == 0
    for t in (5, 77, 401):
        gpu.forward(np.array([t]), cache)
    assert cpu.row_calls == 3 and cpu.row_seconds > 0
    share = cpu_share(cpu, step_us=1e6)
    assert share["blocks"] == 1 and share["bytes_per_token"] == cpu.row_bytes()
    assert share["ram_read_GBps"] > 0 and share["roofline_ms_per_token"] > 0
    assert share["ms_per_token"] == round(cpu.row_seconds / 3 * 1e3, 3)
