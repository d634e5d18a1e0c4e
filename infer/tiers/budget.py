"""How many bytes each tier may hold: measured free memory (or the user's override) minus what the
run needs besides weights — the KV cache and activations on the device, staging in host RAM.

`--vram-budget 24GB` makes a large GPU behave like a 24 GB card: the budget is the total device
memory the engine may use, from which the KV cache, activations and a margin for the CUDA context
and library workspaces are taken before weights are placed. `--ram-budget` does the same for host
memory (tier B plus tier C staging). Without overrides the free VRAM comes from
cudaMemGetInfo and the RAM from psutil, capped by the cgroup v2 memory limit when one applies
(psutil reports the machine's memory, not the container's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from infer.model import ModelArgs
from infer.tiers.plan import format_bytes

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_DECIMAL = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
           "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
DEVICE_MARGIN = 768 << 20  # CUDA context, cuBLAS workspace, allocator slack
HOST_MARGIN = 2 << 30  # the interpreter, tokenizer, page tables; never plan the last bytes of RAM


class BudgetError(ValueError):
    """A budget string that does not parse, or a budget too small for the run."""


def parse_size(text: str) -> int:
    """'24GB' -> 24*10**9, '512MiB' -> 512*2**20, '8G' -> 8*2**30 (single letters are binary, as
    in dd and llama.cpp), '1000' -> 1000 bytes."""
    match = _SIZE.match(text or "")
    if not match:
        raise BudgetError(f"cannot read '{text}' as a size (examples: 24GB, 512MiB, 8G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    scale = _DECIMAL.get(unit) or _BINARY.get(unit)
    if scale is None:
        raise BudgetError(f"unknown size unit '{match.group(2)}' in '{text}' (use B, KB, MB, GB, KiB, MiB, GiB)")
    return int(number * scale)


def kv_cache_nbytes(args: ModelArgs, ctx_size: int, batch: int, itemsize: int = 2) -> int:
    """Keys and values of every layer for `batch` sequences of `ctx_size` positions (float16)."""
    return 2 * args.n_layers * batch * ctx_size * args.kv_dim * itemsize


def activation_nbytes(args: ModelArgs, tokens_per_pass: int, ctx_size: int, batch: int) -> int:
    """An upper estimate of the device work buffers of one pass: float32 hidden states, QKV,
    gate/up, float16 copies for the matrix products, attention scores of a prompt chunk, and logits.
    Planning with it keeps the weights from taking memory the forward pass will ask for later."""
    rows = max(tokens_per_pass, batch)
    per_row = 4 * (3 * args.dim + args.q_dim + 2 * args.kv_dim + 3 * args.ffn_dim + args.vocab_size)
    per_row += 2 * (args.dim + 2 * args.ffn_dim)
    scores = 4 * args.n_heads * tokens_per_pass * ctx_size
    dequant_scratch = 2 * args.ffn_dim * args.dim  # one matrix as float16 for a batched product
    return rows * per_row + scores + dequant_scratch


@dataclass(frozen=True)
class Budgets:
    """Bytes free for weights on the device (tiers A and ring slots) and in host RAM (tier B)."""

    vram_total: int  # what the engine may use on the device, before deductions
    vram_for_weights: int
    ram_total: int
    ram_for_weights: int
    kv_cache: int
    activations: int
    staging: int
    vram_source: str  # "--vram-budget", "cudaMemGetInfo" or "cpu simulation"
    ram_source: str


def free_vram() -> int:
    import cupy

    free, _total = cupy.cuda.runtime.memGetInfo()
    return int(free)


def cgroup_memory_available(root: Path = Path("/sys/fs/cgroup"),
                            membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes the current cgroup v2 may still allocate (memory.max − memory.current), or None."""
    try:
        line = next(x for x in membership.read_text().splitlines() if x.startswith("0::"))  # the v2 entry
        group = root / line.split("::", 1)[1].lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, StopIteration, ValueError):
        return None


def available_ram() -> int:
    import psutil

    free = int(psutil.virtual_memory().available)
    limited = cgroup_memory_available()
    return min(free, limited) if limited is not None else free


def compute_budgets(args: ModelArgs, ctx_size: int, batch: int, tokens_per_pass: int, staging_nbytes: int,
                    vram_budget: str | int | None = None, ram_budget: str | int | None = None,
                    device: bool = True) -> Budgets:
    """The bytes left for weights after the run's own needs. `device=False` (the CPU simulation)
    requires both budgets to be given."""
    kv = kv_cache_nbytes(args, ctx_size, batch)
    act = activation_nbytes(args, tokens_per_pass, ctx_size, batch)
    if vram_budget is not None:
        vram_total = parse_size(vram_budget) if isinstance(vram_budget, str) else int(vram_budget)
        vram_source = "--vram-budget"
    elif device:
        vram_total, vram_source = free_vram(), "cudaMemGetInfo"
    else:
        raise BudgetError("the CPU simulation needs an explicit VRAM budget")
    if ram_budget is not None:
        ram_total = parse_size(ram_budget) if isinstance(ram_budget, str) else int(ram_budget)
        ram_source = "--ram-budget"
    else:
        ram_total, ram_source = max(0, available_ram() - HOST_MARGIN), "available RAM (psutil/cgroup)"
    margin = DEVICE_MARGIN if device else 0
    vram_weights = vram_total - kv - act - margin
    if vram_weights <= 0:
        raise BudgetError(
            f"VRAM budget {format_bytes(vram_total)} cannot hold the KV cache ({format_bytes(kv)} for "
            f"{batch} x {ctx_size} positions) and activations ({format_bytes(act)}): give more than "
            f"{format_bytes(kv + act + margin)} plus the weights' working set, or lower -c/--batch")
    return Budgets(vram_total, vram_weights, ram_total, max(0, ram_total - staging_nbytes), kv, act,
                   staging_nbytes, vram_source, ram_source)
