"""A model split across GPUs in stages (infer.gpu.stages, `--gpus`) against the same model on one
GPU, in the same run: prompt and greedy decode speed through the engine's host-driven calls (the
ones a split model serves), whether every token matches, the first GPU's peak memory (where both
stages sit in the stand-in) and the bytes a decode pass hands from stage to stage.

    python -m bench.stages_bench --synth 8b:q4_k_m --gpus 0,1 [--vram-budget 24GB] [--json] [--out r.json]
    python -m bench.stages_bench --model m.gguf --gpus 0,0     # the stand-in: both stages on GPU 0

With the same GPU named twice the stages share it and hand over by device copies: the ratio is
then the cost of splitting (a fill of each stage's index, a copy of the rows' hidden states, two
graphs a pass instead of one), not the gain of two GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _decode(model, prompt: np.ndarray, steps: int, ctx: int) -> tuple[list[int], float, float]:  # noqa: ANN001
    """(tokens, prompt seconds, decode seconds): the prompt in one call, then greedy steps whose
    choices the device finds (forward_batch_argmax, the scheduler's greedy path)."""
    cache = model.new_cache(ctx)
    began = time.perf_counter()
    token = int(np.argmax(model.forward(prompt, cache, prompt=True)))
    prompt_s = time.perf_counter() - began
    out = [token]
    began = time.perf_counter()
    for _ in range(steps - 1):
        token = int(model.forward_batch_argmax([(np.array([token]), cache)])[0][0])
        out.append(token)
    return out, prompt_s, time.perf_counter() - began


def bench(path: Path, gpus: list[int], budgets: list[str | None], pp: int, tg: int) -> dict[str, object]:
    import cupy

    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer
    from infer.gpu.memory import PeakMonitor
    from infer.gpu.stages import load_gpu_stages
    from infer.tiers.plan import span

    ctx = pp + tg + 8
    prompt = np.random.default_rng(0).integers(3, 1000, pp)
    rows: dict[str, dict[str, object]] = {}
    tokens: dict[str, list[int]] = {}
    for name in ("one GPU", "stages"):
        with PeakMonitor() as peak, cupy.cuda.Device(gpus[0]):
            model = load_gpu_transformer(GGUFModel(path), ctx, budgets[0]) if name == "one GPU" else \
                    load_gpu_stages(GGUFModel(path), gpus, budgets, ctx)
            _decode(model, prompt, 4, ctx)  # warm-up: kernels and graphs of the measured shapes
            tokens[name], prompt_s, decode_s = _decode(model, prompt, tg, ctx)
        row: dict[str, object] = {"pp_tok_s": round(pp / prompt_s, 1), "tg_tok_s": round((tg - 1) / decode_s, 2),
                                  "peak_device_bytes_gpu0": peak.peak}
        if name == "stages":
            row["stages"] = [{"gpu": s.device_id, "layers": span(s.stage),
                              "planned_bytes": s.account.planned_total} for s in model.stages]
            row["link"] = type(model.link).__name__
            row["handover_bytes_per_decode_pass"] = (len(gpus) - 1) * model.args.dim * 4
        rows[name] = row
        del model
        cupy.get_default_memory_pool().free_all_blocks()
    one, staged = rows["one GPU"], rows["stages"]
    return {"model": str(path), "gpus": gpus, "vram_budgets": budgets, "pp": pp, "tg": tg,
            "device": cupy.cuda.runtime.getDeviceProperties(gpus[0])["name"].decode(), **rows,
            "tg_ratio": round(float(staged["tg_tok_s"]) / float(one["tg_tok_s"]), 3),  # type: ignore[arg-type]
            "pp_ratio": round(float(staged["pp_tok_s"]) / float(one["pp_tok_s"]), 3),  # type: ignore[arg-type]
            "tokens_identical": tokens["one GPU"] == tokens["stages"],
            "command": "python -m bench.stages_bench " + " ".join(sys.argv[1:])}


def main(argv: list[str] | None = None) -> None:
    from bench.gpu_bench import synth_path
    from infer.tiers.stage_plan import parse_budgets

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path)
    source.add_argument("--synth", help="synthetic model SHAPE:TYPE, e.g. 8b:q4_k_m (written if missing)")
    parser.add_argument("--synth-dir", type=Path, default=Path("/tmp/nvmedirect-synth"))
    parser.add_argument("--gpus", default="0,0", help="the stages' GPUs; one named twice: both stages on it")
    parser.add_argument("--vram-budget", default=None, help="one size for each GPU, or one per GPU")
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    gpus = [int(g) for g in args.gpus.split(",")]
    path = args.model or synth_path(args.synth, args.synth_dir)
    result = bench(path, gpus, parse_budgets(args.vram_budget, len(gpus)), args.pp, args.tg)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        for name in ("one GPU", "stages"):
            print(f"{name:8s} {result[name]}")  # type: ignore[index]
        print(f"stages / one GPU: decode {result['tg_ratio']}x, prompt {result['pp_ratio']}x; "
              f"tokens identical: {result['tokens_identical']}")
        print(result["command"])


if __name__ == "__main__":
    main()
