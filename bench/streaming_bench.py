"""The streaming benchmark (issue 8) on the H200: a synthetic Llama-70B-shape Q4_K_M behind a
24 GB VRAM budget, measured against the PCIe roofline of the same run, then tier C from the file
under a cgroup memory limit against `dd iflag=direct bs=64M` and the naive mmap baseline.

    python -m bench.streaming_bench --out "$OUT" [--model /path/70b.gguf] [--sections ...]

Sections (each in its own try/except; logs and results.json under --out):
  model    write the synthetic 70B Q4_K_M (or reuse --model / the cached file)
  h2d      pinned host->device bandwidth at 256 MiB and at the ring's slot size
  stream   --vram-budget 24GB, tier B in RAM: single-sequence decode vs the roofline
           (streamed bytes per pass / measured H2D GB/s), pp512, 32 sequences aggregate
  tierc    a child process in a cgroup v2 with a small memory.max: tier C from the file (O_DIRECT)
           read GB/s vs dd on the same file, tok/s vs the mmap baseline (page cache dropped first)
The whole run keeps to --deadline seconds (default 560): a section that cannot finish is skipped
with a note rather than cut by the caller's timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_MODEL = Path(os.environ.get("NVMEDIRECT_BENCH_DIR", "/tmp/nvmd-bench")) / "synth-llama70b-q4_k_m.gguf"
CGROUP = Path("/sys/fs/cgroup/nvmd-streaming-bench")
RESULTS: dict[str, Any] = {}
STARTED = time.monotonic()


def log(out: Path, text: str) -> None:
    line = f"[{time.monotonic() - STARTED:7.1f}s] {text}"
    print(line, flush=True)
    with open(out / "streaming_bench.log", "a") as f:
        f.write(line + "\n")


def save(out: Path, name: str = "results.json") -> None:
    (out / name).write_text(json.dumps(RESULTS, indent=2, default=str))


def section(out: Path, name: str, deadline: float, needs: float, run: Any) -> None:
    left = deadline - (time.monotonic() - STARTED)
    if left < needs:
        RESULTS[name] = {"skipped": f"{left:.0f} s left of the deadline, the section needs about {needs:.0f} s"}
        log(out, f"{name}: skipped ({RESULTS[name]['skipped']})")
        return
    log(out, f"== {name}")
    try:
        RESULTS[name] = run()
    except Exception as err:  # one section failing must not lose the others
        RESULTS[name] = {"error": f"{type(err).__name__}: {err}"}
        log(out, f"{name} failed:\n{traceback.format_exc()}")
    save(out)
    log(out, f"{name}: {json.dumps(RESULTS[name], default=str)}")


# ------------------------------------------------------------------------------------------ model
def ensure_model(path: Path, shape: str) -> dict[str, Any]:
    from infer.synth import SHAPES, write_model

    if path.exists():
        return {"path": str(path), "bytes": path.stat().st_size, "written": False}
    path.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    partial = path.with_suffix(".partial")
    size = write_model(partial, SHAPES[shape], "q4_k_m", seed=0)
    fd = os.open(partial, os.O_RDONLY)
    try:
        os.fsync(fd)  # on disk before anything is timed: writeback would compete with the reads measured later
    finally:
        os.close(fd)
    partial.rename(path)
    return {"path": str(path), "bytes": size, "written": True, "seconds": round(time.perf_counter() - began, 1)}


def h2d_figures(slot_bytes: int) -> dict[str, Any]:
    from infer.tiers.report import measure_host_to_device

    out = {"h2d_256MiB_GBps": round(measure_host_to_device(256 << 20) / 1e9, 2)}
    if slot_bytes:
        out["h2d_slot_GBps"] = round(measure_host_to_device(slot_bytes) / 1e9, 2)
    return out


# ------------------------------------------------------------------------------------------ stream
DEVICE = "gpu"  # --device cpu runs the same sections on the CPU simulation (a smoke test for CI)
# 8 slots let the copies run further ahead of the batched compute than the library's 4 (70B at 24 GB:
# faster 32-sequence decode and pp512, single-sequence decode equal; docs/PERFORMANCE.md).
BENCH_SLOTS = 8
SLOTS = BENCH_SLOTS  # ring slots (--slots)
CPU_TIER: str | int = "off"  # --cpu-tier of the stream section (infer.tiers.cpu_tier)


def _session(model: Path, vram: str, ram: str | None, tier_c: str, ctx: int, batch: int,  # noqa: ANN202
             **extra: Any):
    """A streaming session; `extra`: more StreamingConfig fields (tier C reader settings)."""
    from infer.tiers.session import StreamingConfig, build_streaming_engine

    extra.setdefault("cpu_tier", CPU_TIER if DEVICE == "gpu" else "off")
    config = StreamingConfig(enabled=True, vram_budget=vram, ram_budget=ram, tier_c=tier_c, batch=batch, slots=SLOTS,
                             **extra)
    return build_streaming_engine(str(model), config, ctx, device=DEVICE, measure=True, enforce_budget=DEVICE == "gpu")


def _pass(model, batch: list) -> list:  # noqa: ANN001
    return model.forward_batch(batch)


def _timed_decode(model, caches: list, steps: int) -> float:  # noqa: ANN001
    """Seconds for `steps` decode passes of one token per cache (greedy on the host)."""
    tokens = [np.array([17]) for _ in caches]
    began = time.perf_counter()
    for _ in range(steps):
        logits = _pass(model, list(zip(tokens, caches, strict=True)))
        tokens = [np.array([int(np.argmax(x))]) for x in logits]
    return time.perf_counter() - began


def _vocab(model) -> int:  # noqa: ANN001
    return int(model.args.vocab_size)


def stream_section(out: Path, model: Path, vram: str, decode_steps: int, batch_steps: int,
                   peak_interval: float = 0.002) -> dict[str, Any]:
    if DEVICE != "gpu":
        return _stream_section(out, model, vram, decode_steps, batch_steps)
    from infer.gpu.memory import PeakMonitor

    # set-up, decode, pp512 and the batch: the peak the budget must hold (interval 0: sampled at
    # both ends only, which the memory pool's caching makes the peak but for transient frees)
    with PeakMonitor(peak_interval) as peak:
        res = _stream_section(out, model, vram, decode_steps, batch_steps)
    res["peak_vram_bytes"] = peak.peak
    res["peak_sampling_seconds"] = peak_interval
    res["peak_within_budget"] = peak.peak <= res["vram_budget_bytes"]
    return res


def _stream_section(out: Path, model: Path, vram: str, decode_steps: int, batch_steps: int) -> dict[str, Any]:
    from infer.tiers.plan import Tier

    began = time.perf_counter()
    # KV reserve for 4 sequences of 640 positions covers one 640-position sequence (decode, pp512)
    # and 32 sequences of 64 positions (the batch run), which never coexist
    s = _session(model, vram, None, "file", 640, 4)
    res: dict[str, Any] = {"setup_seconds": round(time.perf_counter() - began, 1)}
    try:
        report = s.report()
        (out / "plan_stream.txt").write_text(report + "\n")
        log(out, report)
        plan, m = s.plan, s.engine.model
        streamed = plan.streamed_nbytes
        h2d = s.bandwidths.host_to_device if s.bandwidths else 0.0
        res.update({"streamed_bytes_per_pass": streamed, "resident_bytes": plan.bytes_in(Tier.VRAM),
                    "tier_b_bytes": plan.bytes_in(Tier.RAM), "tier_c_bytes": plan.bytes_in(Tier.STORAGE),
                    "h2d_GBps_startup": round(h2d / 1e9, 2),
                    "paths": sorted(set(s.paths.values())),
                    "cpu_tier": [n for n in plan.notes if n.startswith("CPU tier")]})
        rng = np.random.default_rng(0)
        vocab = _vocab(m)
        cache = m.new_cache(640)
        m.forward(rng.integers(3, vocab, 16), cache)  # prefill pass, compiling the batched kernels
        _timed_decode(m, [cache], 1)  # one decode pass compiles the GEMV kernels
        seconds = _timed_decode(m, [cache], decode_steps)
        tok_s = decode_steps / seconds
        moved_before = s.weights.bytes_moved()
        res["decode_tok_s"] = round(tok_s, 3)
        res["decode_pass_ms"] = round(1e3 * seconds / decode_steps, 1)
        h2d_now = _link_bandwidth()  # re-measured after the runs, in case the link warmed up or throttled
        res["h2d_GBps_after"] = round(h2d_now / 1e9, 2)
        link = max(h2d, h2d_now)
        res["roofline_tok_s"] = round(link / streamed, 3) if streamed else None
        res["decode_fraction_of_roofline"] = round(tok_s / (link / streamed), 3) if streamed else None
        del cache
        cache = m.new_cache(640)
        prompt = rng.integers(3, vocab, 512)
        t0 = time.perf_counter()
        m.forward(prompt, cache)
        res["pp512_tok_s"] = round(512 / (time.perf_counter() - t0), 1)
        del cache
        caches = [m.new_cache(64) for _ in range(32)]
        t0 = time.perf_counter()
        _pass(m, [(rng.integers(3, vocab, 16), c) for c in caches])  # 32 prompts, one pass
        res["batch32_prefill_seconds"] = round(time.perf_counter() - t0, 2)
        seconds = _timed_decode(m, caches, batch_steps)
        res["batch32_aggregate_tok_s"] = round(32 * batch_steps / seconds, 2)
        moved = s.weights.bytes_moved()
        # pp512, the batch prefill and the batch decode passes; prefetch for the next pass included
        res["bytes_moved_per_pass"] = {k.value: (moved[k] - moved_before[k]) // (2 + batch_steps) for k in moved}
        res["vram_budget_bytes"] = s.budgets.vram_total
        if s.account is not None:
            res["vram_plan"] = {**s.account.planned, **s.account.reserved}
        if DEVICE == "gpu":
            import cupy

            pool = cupy.get_default_memory_pool()
            res["vram_pool_used_bytes"] = int(pool.used_bytes())  # live arrays (weights, slots, caches)
            res["vram_pool_total_bytes"] = int(pool.total_bytes())  # plus freed blocks the pool keeps
    finally:
        s.close()
    return res


def _link_bandwidth() -> float:
    from infer.tiers.report import measure_host_copy, measure_host_to_device

    return measure_host_to_device(256 << 20) if DEVICE == "gpu" else measure_host_copy()


# ------------------------------------------------------------------------------------------ tier C
def drop_file_cache(path: Path) -> str:
    """Evicts the file's pages so mmap reads really go to the disk (fadvise, then drop_caches as root)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if DEVICE != "gpu":  # never drop a shared development machine's caches for a smoke test
        return "fadvise"
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "fadvise+drop_caches"
    except OSError:
        return "fadvise"


def make_cgroup(limit: str) -> Path:
    if not (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():
        raise RuntimeError("cgroup v2 is not mounted at /sys/fs/cgroup")
    CGROUP.mkdir(exist_ok=True)
    with contextlib.suppress(OSError):  # already enabled
        Path("/sys/fs/cgroup/cgroup.subtree_control").write_text("+memory\n")
    (CGROUP / "memory.max").write_text(f"{limit}\n")
    swap = CGROUP / "memory.swap.max"
    if swap.exists():
        swap.write_text("0\n")
    return CGROUP


def tierc_parent(out: Path, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    group = None if args.no_cgroup else make_cgroup(args.cgroup_mem)
    budget = max(60, int(args.deadline - (time.monotonic() - STARTED) - 15))
    cmd = [sys.executable, "-m", "bench.streaming_bench", "--child-tierc", "--out", str(out), "--model", str(model),
           "--vram-budget", args.tierc_vram_budget or args.vram_budget, "--tierc-ram-budget", args.tierc_ram_budget,
           "--deadline", str(budget), "--mmap-seconds", str(args.mmap_seconds), "--device", args.device,
           "--slots", str(args.slots), "--tierc-configs", args.tierc_configs]

    def join_cgroup() -> None:
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    done = subprocess.run(cmd, preexec_fn=join_cgroup, timeout=budget + 10, capture_output=True, text=True)
    (out / "tierc_child.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    child = out / "results_tierc.json"
    result = json.loads(child.read_text()) if child.exists() else {}
    result["child_exit"] = done.returncode
    result["cgroup_memory_max"] = None if group is None else args.cgroup_mem
    return result


def _tierc_configs(text: str) -> list[tuple[int, int]]:
    """'8x4,16x8' -> [(8, 4), (16, 8)]: (reads in flight, staging buffers) per tier C run."""
    try:
        pairs = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise ValueError(f"--tierc-configs wants QDxSTAGING[,...], e.g. 8x4,16x8, not '{text}'")
    return pairs  # type: ignore[return-value]


def _tierc_run(out: Path, model: Path, args: argparse.Namespace, depth: int, staging: int) -> tuple[dict, list]:
    """One streaming session with tier C from the file: a prompt pass, then timed decode passes."""
    from infer.tiers.plan import Tier

    s = _session(model, args.tierc_vram_budget or args.vram_budget, args.tierc_ram_budget, "file", 64, 1,
                 read_queue_depth=depth, staging_buffers=staging, cpu_tier="off")  # tier C: the CPU tier refuses
    try:
        (out / "plan_tierc.txt").write_text(s.report() + "\n")
        c_tensors = s.plan.tensors_in(Tier.STORAGE)
        if not c_tensors:
            raise RuntimeError("the budgets put nothing in tier C: lower --tierc-ram-budget")
        c_bytes = sum(t.nbytes for t in c_tensors)
        RESULTS.update({"tier_c_bytes_per_pass": c_bytes, "tier_b_bytes": s.plan.bytes_in(Tier.RAM)})
        m = s.engine.model
        cache = m.new_cache(64)
        # recorded, not assumed: the source says whether its reads bypassed the page cache, and the
        # file's cached pages are evicted first so a buffered fallback is not timed from RAM
        run: dict[str, Any] = {"queue_depth": depth, "staging_buffers": staging,
                               "o_direct": bool(s.weights.staging.source.direct),
                               "page_cache_drop": drop_file_cache(model)}
        t0 = time.perf_counter()
        m.forward(np.arange(3, 11), cache)  # a prompt of 8 tokens
        run["prefill_pass_seconds"] = round(time.perf_counter() - t0, 2)
        steps = 2
        pass_s = _timed_decode(m, [cache], steps) / steps
        run.update({"decode_tok_s": round(1 / pass_s, 4), "pass_seconds": round(pass_s, 2),
                    "read_GBps": round(c_bytes / pass_s / 1e9, 3)})
        return run, c_tensors
    finally:
        s.close()


def tierc_child(out: Path, model: Path, args: argparse.Namespace) -> None:
    from infer.tiers.tier_c import MmapSource
    from nvmedirect.reader import pinned_empty
    from nvmedirect.reader.bandwidth import measure_dd

    RESULTS["cgroup"] = Path("/proc/self/cgroup").read_text().strip()
    dd_bytes = min(8 << 30, model.stat().st_size // 2)

    def dd() -> float:  # the disk drifts between runs: measured before and after, the mean compared
        row = measure_dd(str(model), dd_bytes, skip_bytes=1 << 30)
        return row.nbytes / row.seconds / 1e9

    dd_before = dd()
    runs = RESULTS.setdefault("file_runs", [])
    c_tensors: list = []
    for depth, staging in _tierc_configs(args.tierc_configs):
        run, c_tensors = _tierc_run(out, model, args, depth, staging)
        runs.append(run)
        save(out, "results_tierc.json")
    dd_after = dd()
    best = max(runs, key=lambda r: r["read_GBps"])
    RESULTS.update({"file_decode_tok_s": best["decode_tok_s"], "file_pass_seconds": best["pass_seconds"],
                    "file_read_GBps": best["read_GBps"], "file_o_direct": all(r["o_direct"] for r in runs),
                    "file_config": f"{best['queue_depth']} reads in flight, {best['staging_buffers']} staging buffers"})
    c_bytes = RESULTS["tier_c_bytes_per_pass"]
    RESULTS["dd_GBps_before_after"] = [round(dd_before, 3), round(dd_after, 3)]
    RESULTS["dd_GBps"] = round((dd_before + dd_after) / 2, 3)
    RESULTS["file_vs_dd"] = round(RESULTS["file_read_GBps"] / RESULTS["dd_GBps"], 3)
    for run in runs:
        run["vs_dd"] = round(run["read_GBps"] / RESULTS["dd_GBps"], 3)
    save(out, "results_tierc.json")
    # the naive baseline: one thread copying out of the mapping, with the file's pages evicted first
    RESULTS["mmap_cache_drop"] = drop_file_cache(model)
    source = MmapSource(model)
    staging = pinned_empty(max(t.nbytes for t in c_tensors))
    moved, t0 = 0, time.perf_counter()
    for t in c_tensors:
        source.read_async([(t.offset, t.nbytes)], [staging]).wait()
        moved += t.nbytes
        if time.perf_counter() - t0 > args.mmap_seconds:
            break
    seconds = time.perf_counter() - t0
    source.close()
    mmap_gbps = moved / seconds / 1e9
    whole = moved == c_bytes
    mmap_pass = c_bytes / (moved / seconds)
    RESULTS.update({"mmap_read_GBps": round(mmap_gbps, 4), "mmap_bytes_timed": moved, "mmap_whole_pass": whole,
                    "mmap_pass_seconds": round(mmap_pass, 1) if whole else f"{mmap_pass:.1f} (extrapolated)",
                    "mmap_decode_tok_s": round(1 / mmap_pass, 5),
                    "file_vs_mmap_tok_s": round(RESULTS["file_decode_tok_s"] * mmap_pass, 1)})
    save(out, "results_tierc.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for logs and results")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--sections", default="model,h2d,stream,tierc")
    parser.add_argument("--vram-budget", default="24GB")
    parser.add_argument("--tierc-ram-budget", default="4GB")
    parser.add_argument("--tierc-vram-budget", help="VRAM budget of the tier C run (default: --vram-budget)")
    parser.add_argument("--cgroup-mem", default="12G", help="memory.max of the tier C child (must be < the model)")
    parser.add_argument("--slots", type=int, default=BENCH_SLOTS, help="ring slots of the streaming pipeline")
    parser.add_argument("--cpu-tier", default="off",
                        help="the stream section's --cpu-tier: auto, off or N (RAM layers on the CPU in passes of <= N tokens)")
    parser.add_argument("--decode-steps", type=int, default=6)
    parser.add_argument("--batch-steps", type=int, default=4)
    parser.add_argument("--mmap-seconds", type=float, default=60.0)
    parser.add_argument("--peak-interval", type=float, default=0.002,
                        help="seconds between device-memory samples in the stream section (0: at both ends only)")
    parser.add_argument("--tierc-configs", default="8x4,16x8",
                        help="tier C runs as QDxSTAGING (reads in flight x staging buffers), comma-separated")
    parser.add_argument("--deadline", type=float, default=560.0)
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: smoke test on the simulation")
    parser.add_argument("--shape", default="70b", help="synthetic shape written by the model section")
    parser.add_argument("--no-cgroup", action="store_true", help="run the tier C child without a memory limit")
    parser.add_argument("--child-tierc", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global DEVICE, SLOTS, CPU_TIER
    from infer.tiers.config import parse_cpu_tier

    DEVICE, SLOTS, CPU_TIER = args.device, args.slots, parse_cpu_tier(args.cpu_tier)
    if args.child_tierc:
        try:
            tierc_child(out, args.model, args)
        except Exception as err:
            RESULTS["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            save(out, "results_tierc.json")
            return 1
        return 0
    wanted = set(args.sections.split(","))
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    RESULTS["command"] = " ".join([sys.executable, "-m", "bench.streaming_bench", *(argv or sys.argv[1:])])
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        RESULTS["gpu"] = smi.stdout.strip()
    except Exception as err:
        RESULTS["gpu"] = f"nvidia-smi: {err}"
    if "model" in wanted:
        section(out, "model", args.deadline, 30, lambda: ensure_model(args.model, args.shape))
    if "h2d" in wanted and DEVICE == "gpu":
        section(out, "h2d", args.deadline, 10, lambda: h2d_figures(200 << 20))
    if "stream" in wanted:
        section(out, "stream", args.deadline, 90,
                lambda: stream_section(out, args.model, args.vram_budget, args.decode_steps, args.batch_steps,
                                       args.peak_interval))
    if "tierc" in wanted:
        section(out, "tierc", args.deadline, 150, lambda: tierc_parent(out, args.model, args))
    save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
