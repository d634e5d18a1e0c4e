"""The figures of docs/PERFORMANCE.md, drawn from the raw JSON committed under docs/results/.

    python -m bench.plots                      # writes docs/results/plots/*.png
    python -m bench.plots --out /tmp/plots     # somewhere else

Each figure names the JSON files it reads (FIGURES); adding a row to docs/results/ and running the
script again redraws them. llama.cpp's and llama-server's figures come from
docs/results/reference/llama-cpp-anchors.json (transcribed from shared/ANCHORS.md, where those
reference runs are recorded).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a CI machine or the device host
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
DAY = "2026-12-01"
REFERENCE = "reference/llama-cpp-anchors.json"
RUN8 = "2026-12-03/issue24-run8-70b-verify-24GB.json"  # the one-pass engine's verify curve
OURS, THEIRS = "tab:blue", "tab:orange"


def load(name: str) -> dict[str, Any]:
    with open(RESULTS / name, encoding="utf-8") as f:
        return json.load(f)


def verify_curve(ax_fig: tuple[Any, Any]) -> None:
    """The 70B verify pass: seconds per pass against the tokens (tree nodes) the pass holds."""
    fig, ax = ax_fig
    for name, label, style in ((f"{DAY}/issue14-70b-verify-exact-passes.json",
                                "verify_tree, 2026-12-01 (exact: the decode step's kernels)", "o-"),
                               (f"{DAY}/issue14-70b-verify-passes.json",
                                "forward_tree, 2026-12-01 (float16 products, not exact)", "s--"),
                               (RUN8, "verify_tree, 2026-12-03 (one pass for N rows, exact)", "^-")):
        passes = load(name)["passes"]
        ax.plot([p["nodes"] for p in passes], [p["pass_seconds"] for p in passes], style, label=label)
    ax.set_xscale("log", base=2)
    ticks = [p["nodes"] for p in load(f"{DAY}/issue14-70b-verify-passes.json")["passes"]]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("tokens per pass (tree nodes)")
    ax.set_ylabel("seconds per pass")
    ax.set_ylim(bottom=0)
    ax.set_title("Synthetic 70B Q4_K_M streamed at a 24 GB VRAM budget (H200)")
    ax.grid(True, alpha=0.3)
    ax.legend()


def decode_vs_budget(ax_fig: tuple[Any, Any]) -> None:
    """Single-sequence decode tok/s against the device memory a run may use, 8B and 70B, ours
    (the budget where one was set, else the peak measured) beside llama.cpp's (its layers' size).
    Runs of one setting share a point's label: their figures, in order."""
    fig, axes = ax_fig
    ours = {"8B Q4_K_M": [(f"{DAY}/issue13-8b-q4km-nobudget.json", "resident, no budget (peak)"),
                          (f"{DAY}/issue13-8b-q4km-8GB.json", "resident, 8 GB budget"),
                          (f"{DAY}/issue13-8b-q4km-streaming-8GB.json", "streaming engine, 8 GB budget")],
            "70B Q4_K_M": [(f"{DAY}/issue13-70b-stream-run4.json", "streamed, 24 GB budget (runs 4, 5a, 5b)"),
                           (f"{DAY}/issue13-70b-stream-run5a.json", "streamed, 24 GB budget (runs 4, 5a, 5b)"),
                           (f"{DAY}/issue13-70b-stream-run5b.json", "streamed, 24 GB budget (runs 4, 5a, 5b)")]}
    reference = load(REFERENCE)["decode"]
    for ax, (model, runs) in zip(axes, ours.items(), strict=True):
        groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for name, label in runs:
            row = load(name)
            row = row.get("stream", row)
            budget = row["vram_budget_bytes"] / 1e9
            used = budget if budget < 100 else row["peak_vram_bytes"] / 1e9  # "no budget": all free VRAM
            groups.setdefault(("ours", label), []).append((used, row.get("tg_tok_s") or row["decode_tok_s"]))
        for r in (r for r in reference if r["model"] == model):
            what = "llama.cpp, " + r["what"].split(", ", 1)[-1].replace(", 16 CPU threads", ", 16 threads")
            groups.setdefault(("theirs", what), []).append((r["vram_gb"], r["decode_tok_s"]))
        stacked: dict[float, int] = {}  # labels already at a point's x: the next goes below them
        for (who, label), points in groups.items():
            color, marker = (OURS, "o") if who == "ours" else (THEIRS, "^")
            ax.scatter([x for x, _ in points], [y for _, y in points], color=color, marker=marker, zorder=3)
            x, y = points[0]
            figures = " / ".join(f"{v:g}" for _, v in points)
            below = stacked.get(round(x), 0)
            stacked[round(x)] = below + 1
            ax.annotate(f"{label}: {figures}", (x, y), textcoords="offset points",
                        xytext=(7, (6 if who == "ours" else -10) - 11 * below), fontsize=7, color=color)
        if model.startswith("70B"):  # 2 to 45 tok/s: a log axis keeps both ends readable
            ax.set_yscale("log")
            ax.set_xlim(0, 75)
        else:
            ax.set_ylim(0, 420)
            ax.set_xlim(0, 40)
        ax.set_xlabel("VRAM budget (GB; peak used where none was set)")
        ax.set_ylabel("decode tok/s, one sequence")
        ax.set_title(model)
        ax.grid(True, alpha=0.3, which="both")
    axes[0].scatter([], [], color=OURS, label="ntransformer")
    axes[0].scatter([], [], color=THEIRS, marker="^", label="llama.cpp")
    axes[0].legend(loc="lower right")


def _mid(value: float | list[float]) -> tuple[float, float]:
    """(middle, half range) of a figure given as a number or a [low, high] range."""
    low, high = (value, value) if isinstance(value, int | float) else value
    return (low + high) / 2, (high - low) / 2


def server(ax_fig: tuple[Any, Any]) -> None:
    """Server throughput and time to first token against concurrent clients, ours and llama-server."""
    fig, (tput, ttft) = ax_fig
    for name, label in ((f"{DAY}/issue16-server-8b-64clients.json", "ours, 8B resident"),
                        (f"{DAY}/issue16-server-70b-32clients.json", "ours, 70B streamed at 24 GB")):
        s = load(name)["server"]
        marker = "o" if "8B" in label else "D"
        tput.scatter([s["clients"]], [s["aggregate_tok_s"]], color=OURS, marker=marker, label=label, zorder=3)
        ttft.errorbar([s["clients"]], [s["ttft_p50_s"]], yerr=[[0], [s["ttft_p95_s"] - s["ttft_p50_s"]]],
                      color=OURS, marker=marker, capsize=3, label=label)
    for r in load(REFERENCE)["serving"]:
        mine = r["who"].startswith("ntransformer")
        color, label = (OURS, "ours, 8B (2026-12-02, beside llama-server)") if mine else (THEIRS, "llama-server, 8B")
        for ax, key in ((tput, "aggregate_tok_s"), (ttft, "ttft_p50_s")):
            mid, half = _mid(r[key])
            ax.errorbar([r["clients"]], [mid], yerr=[half], color=color, marker="s" if mine else "^", capsize=3,
                        label=label, linestyle="none")
    for ax, what in ((tput, "aggregate tok/s"), (ttft, "time to first token, p50 (bar: to p95 or range), s")):
        ax.set_xlabel("concurrent clients (streaming, 64 tokens each)")
        ax.set_ylabel(what)
        ax.set_xscale("log", base=2)
        ax.set_xlim(16, 128)
        ax.set_xticks([16, 32, 64, 128], ["16", "32", "64", "128"])
        ax.grid(True, alpha=0.3)
    tput.set_yscale("log")
    tput.set_ylim(30, 3000)
    tput.set_title("Throughput")
    ttft.set_ylim(bottom=0)
    ttft.set_title("Time to first token")
    tput.legend(fontsize=7, loc="upper right")


def speculation(ax_fig: tuple[Any, Any]) -> None:
    """Speculative tokens per target pass by prompt set (Qwen2.5-Coder 1.5B target, 0.5B draft):
    the per-prompt spread of the end-to-end GPU runs, and the CPU curve against the tree size."""
    fig, (runs, curve) = ax_fig
    sets = [(f"{DAY}/issue14-e2e-h200-run6-final-40-prompts.json", "10x1", "HumanEval 40\nchain 10 (run 6)"),
            (f"{DAY}/issue14-e2e-h200-run6-final-40-prompts.json", "auto", "HumanEval 40\ntuned (run 6)"),
            (f"{DAY}/issue14-e2e-h200-run7-device-argmax-10x1-40-prompts.json", "10x1", "HumanEval 40\nchain 10 (run 7)"),
            (f"{DAY}/issue14-e2e-h200-run5-draft-prefill-10x1-20-prompts.json", "10x1", "HumanEval 20\nchain 10 (run 5)"),
            (f"{DAY}/issue14-e2e-qwen15b-streamed-qwen05b-draft-h200-run3-16x1.json", "16x1",
             "HumanEval 40\nchain 16 (run 3)")]
    data, labels = [], []
    for name, shape, label in sets:
        rows = load(name)["rows"]
        data.append([r[shape]["tokens_per_pass"] for r in rows])
        labels.append(label)
    runs.boxplot(data, showmeans=True)
    runs.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
    for i, values in enumerate(data, start=1):
        runs.scatter([i] * len(values), values, s=6, alpha=0.4, color=OURS)
    runs.set_ylabel("tokens per target pass (each dot a prompt)")
    runs.set_title("End to end on the H200, 128 greedy tokens per prompt")
    runs.grid(True, alpha=0.3, axis="y")
    cpu = load(f"{DAY}/issue14-acceptance-qwen05b-qwen15b-cpu.json")
    for width in sorted({s["width"] for s in cpu["shapes"]}):
        shapes = [s for s in cpu["shapes"] if s["width"] == width]
        curve.plot([s["nodes"] for s in shapes], [s["tokens_per_pass"] for s in shapes], "o-",
                   label=f"width {width} (chain + {width - 1} siblings per step)")
    curve.set_xscale("log", base=2)
    ticks = sorted({s["nodes"] for s in cpu["shapes"]})[::2]
    curve.set_xticks(ticks, [str(t) for t in ticks])
    curve.set_xlabel("tree nodes")
    curve.set_ylabel("tokens per target pass")
    curve.set_title(f"{cpu['prompts']} prompts x {cpu['tokens']} tokens, CPU (simulated from the draft's ranks)")
    curve.grid(True, alpha=0.3)
    curve.legend(fontsize=7)


# name -> (draw, subplot columns, figure size, the JSON files it reads)
S27 = "2026-12-06/session27"  # the synthetic Qwen3-30B-A3B beside llama.cpp, one lease (C) and the first run (A)


def _llama_rates(name: str) -> tuple[float, float]:
    """(pp512, decode) tok/s of a llama-bench JSON."""
    rows = load(name)
    return (next(r["avg_ts"] for r in rows if r["n_prompt"]), next(r["avg_ts"] for r in rows if r["n_gen"]))


def _moe_bars(ax_fig: tuple[Any, Any], ours: dict[str, dict], theirs: dict[str, tuple[float, float]],
              marks: dict[str, dict], mark_label: str, card: str = "H100") -> None:
    """Decode and pp512 bars of ours and llama.cpp per budget, `marks` (an earlier run of ours) as crosses."""
    _fig, (dec, pp) = ax_fig
    xs = range(len(ours))
    for ax, key, which, title in ((dec, "tg_tok_s", 1, "decode, one sequence"), (pp, "pp_tok_s", 0, "prompt, 512 tokens")):
        ax.bar([x - 0.2 for x in xs], [ours[b][key] for b in ours], 0.4, color=OURS, label="ours")
        ax.bar([x + 0.2 for x in xs], [theirs[b][which] for b in ours], 0.4, color=THEIRS,
               label="llama.cpp (-ngl 99; -ncmoe 32 at 8 GB)")
        ax.plot([x - 0.2 for x, b in zip(xs, ours, strict=True) if b in marks], [marks[b][key] for b in ours if b in marks],
                "kx", label=mark_label)
        ax.set_xticks(list(xs), [f"--vram-budget {b}" for b in ours])
        ax.set_ylabel("tok/s")
        ax.set_title(f"Synthetic Qwen3-30B-A3B Q4_K_M, {title} ({card})")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)


def moe_beside_llama(ax_fig: tuple[Any, Any]) -> None:
    """The synthetic Qwen3-30B-A3B Q4_K_M at 24 GB (every expert in VRAM) and 8 GB (32 blocks'
    experts on the CPU): decode and pp512, ours beside llama.cpp measured in the same lease."""
    ours = {"24 GB": load(f"{S27}/run6/gpu-bench-30b-a3b-24GB.json"), "8 GB": load(f"{S27}/run8/gpu-bench-8GB-old.json")}
    theirs = {"24 GB": _llama_rates(f"{S27}/run8/llama-moe-ngl99.json"),
              "8 GB": _llama_rates(f"{S27}/run8/llama-moe-ncmoe32.json")}
    first = {"24 GB": load(f"{S27}/run1/gpu-bench-30b-a3b-24GB.json")}  # lease A: before session 27's kernels
    _moe_bars(ax_fig, ours, theirs, first, "ours, the first GPU run (another lease)")


S28 = "2026-12-06/session28"  # the same after grouping the pairs by expert and streaming the CPU's blocks


def moe_beside_llama_grouped(ax_fig: tuple[Any, Any]) -> None:
    """Session 28: 24 GB (lease C) and 8 GB (lease B: 33 blocks' experts on the CPU, long prompts
    streaming them), each beside llama.cpp in its lease; session 27's figures as crosses."""
    ours = {"24 GB": load(f"{S28}/run6/bench-24GB.json"), "8 GB": load(f"{S28}/run5/bench-8GB.json")}
    theirs = {"24 GB": _llama_rates(f"{S28}/run6/llama-ngl99.json"), "8 GB": _llama_rates(f"{S28}/run5/llama-ncmoe32.json")}
    before = {"24 GB": load(f"{S27}/run6/gpu-bench-30b-a3b-24GB.json"), "8 GB": load(f"{S27}/run8/gpu-bench-8GB-old.json")}
    _moe_bars(ax_fig, ours, theirs, before, "ours, session 27 (another lease)")


S29 = "2026-12-06/session29"  # the same after the route by ranks, the attention's head splits


def moe_beside_llama_session29(ax_fig: tuple[Any, Any]) -> None:
    """Session 29: 24 GB (run 4) and 8 GB (run 2, another host), each beside llama.cpp in its lease;
    session 28's figures as crosses."""
    ours = {"24 GB": load(f"{S29}/run4/bench-24GB.json"), "8 GB": load(f"{S29}/run2/bench-8GB.json")}
    theirs = {"24 GB": _llama_rates(f"{S29}/run4/llama-ngl99.json"), "8 GB": _llama_rates(f"{S29}/run2/llama-ncmoe32.json")}
    before = {"24 GB": load(f"{S28}/run6/bench-24GB.json"), "8 GB": load(f"{S28}/run5/bench-8GB.json")}
    _moe_bars(ax_fig, ours, theirs, before, "ours, session 28 (another lease)")


S31 = "2026-12-06/session31"  # programmatic dependent launch; one H200 lease


def moe_beside_llama_session31(ax_fig: tuple[Any, Any]) -> None:
    """Session 31 (one H200 lease): 24 GB with the replayed kernels launched to wait on the GPU (run
    4) and 8 GB (run 2), beside llama.cpp in that lease; at 24 GB the same launches without it
    (NVMEDIRECT_PDL=0) as a cross."""
    ours = {"24 GB": load(f"{S31}/run4/bench-24GB-pdl-a.json"), "8 GB": load(f"{S31}/run2/bench-8GB.json")}
    theirs = {"24 GB": _llama_rates(f"{S31}/run4/llama-ngl99.json"), "8 GB": _llama_rates(f"{S31}/run2/llama-ncmoe32.json")}
    plain = {"24 GB": load(f"{S31}/run4/bench-24GB-plain.json")}
    _moe_bars(ax_fig, ours, theirs, plain, "ours, plain launches (NVMEDIRECT_PDL=0, same lease)", card="H200")


FIGURES: dict[str, tuple[Callable[[tuple[Any, Any]], None], int, tuple[float, float], list[str]]] = {
    "verify-pass-time-70b": (verify_curve, 1, (7, 4.2), [f"{DAY}/issue14-70b-verify-exact-passes.json",
                                                        f"{DAY}/issue14-70b-verify-passes.json", RUN8]),
    "decode-vs-vram-budget": (decode_vs_budget, 2, (12, 4.6), [f"{DAY}/issue13-8b-q4km-nobudget.json",
                                                              f"{DAY}/issue13-70b-stream-run5a.json", REFERENCE]),
    "server-clients": (server, 2, (12, 4.4), [f"{DAY}/issue16-server-8b-64clients.json",
                                             f"{DAY}/issue16-server-70b-32clients.json", REFERENCE]),
    "speculative-tokens-per-pass": (speculation, 2, (13, 4.8), [f"{DAY}/issue14-e2e-h200-run6-final-40-prompts.json",
                                                               f"{DAY}/issue14-acceptance-qwen05b-qwen15b-cpu.json"]),
    "moe-beside-llama": (moe_beside_llama, 2, (12, 4.4), [f"{S27}/run6/gpu-bench-30b-a3b-24GB.json",
                                                         f"{S27}/run8/gpu-bench-8GB-old.json",
                                                         f"{S27}/run8/llama-moe-ngl99.json",
                                                         f"{S27}/run8/llama-moe-ncmoe32.json",
                                                         f"{S27}/run1/gpu-bench-30b-a3b-24GB.json"]),
    "moe-beside-llama-grouped": (moe_beside_llama_grouped, 2, (12, 4.4),
                                 [f"{S28}/run6/bench-24GB.json", f"{S28}/run5/bench-8GB.json",
                                  f"{S28}/run6/llama-ngl99.json", f"{S28}/run5/llama-ncmoe32.json",
                                  f"{S27}/run6/gpu-bench-30b-a3b-24GB.json", f"{S27}/run8/gpu-bench-8GB-old.json"]),
    "moe-beside-llama-session29": (moe_beside_llama_session29, 2, (12, 4.4),
                                   [f"{S29}/run4/bench-24GB.json", f"{S29}/run2/bench-8GB.json",
                                    f"{S29}/run4/llama-ngl99.json", f"{S29}/run2/llama-ncmoe32.json",
                                    f"{S28}/run6/bench-24GB.json", f"{S28}/run5/bench-8GB.json"]),
    "moe-beside-llama-session31": (moe_beside_llama_session31, 2, (12, 4.4),
                                   [f"{S31}/run4/bench-24GB-pdl-a.json", f"{S31}/run2/bench-8GB.json",
                                    f"{S31}/run4/llama-ngl99.json", f"{S31}/run2/llama-ncmoe32.json",
                                    f"{S31}/run4/bench-24GB-plain.json"]),
}


def draw(out: Path) -> list[Path]:
    """Every figure as a PNG under `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (draw_one, columns, size, _sources) in FIGURES.items():
        fig, axes = plt.subplots(1, columns, figsize=size)
        draw_one((fig, axes))
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "plots", help="folder for the PNGs")
    for path in draw(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
