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
from dataclasses import dataclass, field
from pathlib import Path

from infer.arch import ModelArgs
from infer.tiers.plan import format_bytes

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_DECIMAL = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
           "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
DEVICE_MARGIN = 768 << 20  # CUDA context, cuBLAS workspace, allocator slack
HOST_MARGIN = 2 << 30  # the interpreter, tokenizer, page tables; never plan the last bytes of RAM


class BudgetError(ValueError):
    """A budget string that does not parse, or a budget too small for the run."""


class VramBudgetError(BudgetError):
    """The run needs more device memory than its VRAM budget (planned, or hit while running)."""


@dataclass
class VramAccount:
    """Every device allocation of a run against the VRAM budget: what lies outside CuPy's memory pool
    (`reserved`: the CUDA context and whatever else held device memory when the engine started, the
    cuBLAS workspace, kernel modules and graphs) and what the pool holds (`planned`: weights, KV
    cache, activations, ring slots, layer scratch, float16 copies). The pool's limit is the budget
    less the reserved part (infer.gpu.memory.enforce), so an overrun is an error, not a silent
    overshoot."""

    budget: int
    source: str
    reserved: dict[str, int]
    planned: dict[str, int] = field(default_factory=dict)
    what: str = "the run"  # the subject of the error message ("SmolLM2.gguf on the GPU")

    @property
    def pool_limit(self) -> int:
        return self.budget - sum(self.reserved.values())

    @property
    def planned_total(self) -> int:
        return sum(self.planned.values())

    @property
    def room(self) -> int:
        """Pool bytes not yet planned."""
        return self.pool_limit - self.planned_total

    def plan(self, name: str, nbytes: int) -> None:
        self.planned[name] = self.planned.get(name, 0) + int(nbytes)

    def check(self, hint: str = "") -> None:
        """Raises VramBudgetError (one line, with what each part takes) when the plan exceeds the budget."""
        if self.room >= 0:
            return
        need = self.planned_total + sum(self.reserved.values())
        raise VramBudgetError(f"{self.what} needs {format_bytes(need)} of VRAM ({self.breakdown()}) but the budget "
                              f"is {format_bytes(self.budget)} ({self.source}){hint}")

    def breakdown(self) -> str:
        parts = {**self.planned, **self.reserved}
        return ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items() if n)

    def render(self) -> str:
        return (f"VRAM budget {format_bytes(self.budget)} ({self.source}): " + self.breakdown()
                + f"; {format_bytes(max(self.room, 0))} left")


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


def kv_cache_nbytes(args: ModelArgs, ctx_size: int, batch: int, pass_rows: int, itemsize: int = 2) -> int:
    """Keys and values of every layer for `batch` sequences of `ctx_size` positions (float16), for
    passes of up to pass_rows rows (a local layer keeps a ring of its window and a pass)."""
    return batch * args.kv_cache_nbytes(ctx_size, pass_rows, itemsize)


ATTENTION_SCORES_BYTES = 32 << 20  # CPU prompt attention computes scores in blocks of query rows of about this size
LOGITS_ROWS = 64  # logits of many rows (a scored prompt) are computed this many rows at a time


def activation_nbytes(args: ModelArgs, tokens_per_pass: int, ctx_size: int, batch: int,
                      largest_matrix: int | None = None) -> int:
    """An upper bound of the work buffers of one pass of the CPU simulation's engine: the decode
    vectors, the hidden states and products of many rows, the prompt attention of one sequence,
    a block of logits and one dequantized matrix. (The GPU engine's pass buffers are counted by
    infer.gpu.gpu_pass_nbytes and given to compute_budgets as `activations`.)"""
    rows = max(tokens_per_pass, batch)
    a = args
    decode = 4 * (4 * a.dim + 2 * (a.q_dim + 2 * a.kv_dim) + 4 * a.ffn_dim + a.vocab_size) + 2 * (a.dim + a.ffn_dim)
    hidden = 4 * a.dim + 16 * a.dim + 4 * (a.q_dim + 2 * a.kv_dim) + 10 * a.q_dim + 14 * a.ffn_dim
    scores = min(ATTENTION_SCORES_BYTES, 4 * a.n_heads * rows * ctx_size)  # one block of query rows
    attention = 8 * a.kv_dim * ctx_size + 4 * scores + 16 * rows * a.q_dim
    logits = 4 * min(rows, LOGITS_ROWS) * a.vocab_size
    biggest = largest_matrix if largest_matrix is not None else a.largest_matrix
    return decode + rows * hidden + attention + logits + 2 * biggest


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
    vram_reserved: int = DEVICE_MARGIN  # taken off vram_total besides KV cache and activations


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
                    device: bool = True, device_reserved: int | None = None,
                    largest_matrix: int | None = None, activations: int | None = None) -> Budgets:
    """The bytes left for weights after the run's own needs. `device=False` (the CPU simulation)
    requires both budgets to be given. device_reserved: device bytes outside the memory pool
    (measured by infer.gpu.memory; default DEVICE_MARGIN). activations: the engine's own count of
    its pass buffers (the GPU's), else activation_nbytes."""
    kv = kv_cache_nbytes(args, ctx_size, batch, tokens_per_pass) + 4 * batch * (ctx_size + 1)  # + the token histories
    act = activation_nbytes(args, tokens_per_pass, ctx_size, batch, largest_matrix) if activations is None \
        else activations
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
    margin = (DEVICE_MARGIN if device_reserved is None else device_reserved) if device else 0
    vram_weights = vram_total - kv - act - margin
    if vram_weights <= 0:
        reserve = f", the device reserve ({format_bytes(margin)}: CUDA context, cuBLAS, kernels)" if margin else ""
        raise BudgetError(
            f"VRAM budget {format_bytes(vram_total)} cannot hold the KV cache ({format_bytes(kv)} for "
            f"{batch} x {ctx_size} positions) and activations ({format_bytes(act)}){reserve}: give more than "
            f"{format_bytes(kv + act + margin)} plus the weights' working set, or lower -c/--batch")
    return Budgets(vram_total, vram_weights, ram_total, max(0, ram_total - staging_nbytes), kv, act,
                   staging_nbytes, vram_source, ram_source, margin)
