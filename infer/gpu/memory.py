"""The VRAM budget on the device: what is outside CuPy's memory pool, the pool's limit, and the
peak the driver reports.

Everything the engine allocates (weights, KV cache, pass buffers, ring slots, scratch) goes through
CuPy's default memory pool; `enforce` caps the pool at the budget less what lies outside it, so an
overrun raises OutOfMemoryError (turned into a one-line VramBudgetError by `over_budget`) instead of
growing past the budget. Outside the pool are the CUDA context and anything else on the device when
the engine starts (measured), and kernel modules and CUDA graphs. No product uses cuBLAS.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import cupy

from infer.tiers.budget import VramAccount, VramBudgetError, format_bytes, parse_size

MODULES_AND_GRAPHS = 128 << 20  # compiled kernel modules, instantiated graphs, library handles
# The pool rounds every allocation up to 512 B and the weight arena aligns each tensor so: a plan that
# counts exact tensor bytes runs over by up to 512 B a buffer. The planner fills tier A to the last
# byte of the budget (90 KiB were left on 2026-12-03 when the Qwen pair's KV cache failed 0.35 MiB
# short), so this much of the pool is kept out of every plan; the pool itself may use it.
POOL_ROUNDING = 2 << 20
POOL_ROUNDING_NAME = "pool rounding (512 B a buffer)"
# Per-thread stack the driver reserves local memory for, for every thread the device can hold: its
# default 1 KiB is ~277 MB on an H200 (~170 MB on an RTX 4090); the engine's kernels need at most
# 256 B (attn_merge), and the driver raises the limit by itself for a kernel that needs more.
THREAD_STACK_BYTES = 256
FREE_MARGIN = 512 << 20  # without --vram-budget: the free memory less this


def device_memory() -> tuple[int, int]:
    """(free, total) bytes of the current device, as the driver reports them."""
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(free), int(total)


def limit_thread_stack(nbytes: int = THREAD_STACK_BYTES) -> None:
    """Lowers the per-thread stack limit to nbytes (never raises it): the local memory the driver
    keeps for it is outside any pool and counts against the VRAM budget (H200, 8B resident at 6 GB:
    528.8 -> 330.8 MiB outside the pool, 2026-12-02, scripts/vram_probe.py)."""
    rt = cupy.cuda.runtime
    if rt.deviceGetLimit(rt.cudaLimitStackSize) > nbytes:
        rt.deviceSetLimit(rt.cudaLimitStackSize, nbytes)


def new_account(vram_budget: str | int | None, what: str) -> VramAccount:
    """The account of a run starting now: its budget (the user's, or the free memory less a margin)
    and the device memory outside the pool (after the stack limit is lowered)."""
    limit_thread_stack()
    free, total = device_memory()
    pool = cupy.get_default_memory_pool()
    in_use = total - free - int(pool.total_bytes())  # the context and other processes, not our pool
    reserved = {"CUDA context and other processes": in_use, "kernels and graphs": MODULES_AND_GRAPHS,
                POOL_ROUNDING_NAME: POOL_ROUNDING}
    if vram_budget is None:
        return VramAccount(in_use + free - FREE_MARGIN, f"free memory less {format_bytes(FREE_MARGIN)}", reserved,
                           what=what)
    budget = parse_size(vram_budget) if isinstance(vram_budget, str) else int(vram_budget)
    if budget > total:
        raise VramBudgetError(f"VRAM budget {format_bytes(budget)} exceeds the GPU's {format_bytes(total)}")
    return VramAccount(budget, "--vram-budget", reserved, what=what)


_enforced: list[VramAccount] = []


def enforce(account: VramAccount) -> None:
    """Caps CuPy's pool at the account's pool limit plus the rounding kept out of the plan
    (process-wide: one engine per process)."""
    cupy.get_default_memory_pool().set_limit(size=max(account.pool_limit + account.reserved.get(POOL_ROUNDING_NAME, 0), 0))
    _enforced[:] = [account]


def current_account() -> VramAccount | None:
    """The account last enforced in this process."""
    return _enforced[0] if _enforced else None


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, cupy.cuda.memory.OutOfMemoryError)


def over_budget(err: Exception, account: VramAccount | None) -> VramBudgetError:
    """The one-line error for a device allocation that failed under the budget."""
    pool = cupy.get_default_memory_pool()
    where = f"the VRAM budget {format_bytes(account.budget)} ({account.source})" if account else "the GPU's memory"
    return VramBudgetError(f"out of device memory: {format_bytes(pool.total_bytes())} held by the engine's pool "
                           f"could not grow within {where} (lower -c/--ctx-size or --batch, or raise the budget)")


@contextmanager
def transient_pool() -> Iterator[None]:
    """Allocations inside the block go to a pool of their own, capped at what the engine's pool may
    still take, and go back to the driver whole when it ends: a transient (a tensor's GGUF bytes
    before the device repacks them) freed in the engine's pool would stay there as free fragments
    that later buffers may not fit, counted against the VRAM budget."""
    engine = cupy.get_default_memory_pool()
    staging = cupy.cuda.MemoryPool()
    if engine.get_limit():  # what the engine's pool and the enclosing blocks' pools leave
        taken = engine.total_bytes() + sum(int(p.total_bytes()) for p in _transient)
        staging.set_limit(size=max(engine.get_limit() - taken, 0))
    _transient.append(staging)
    try:
        with cupy.cuda.using_allocator(staging.malloc):
            yield
    finally:
        _transient.remove(staging)
        cupy.cuda.get_current_stream().synchronize()  # the block's kernels are done with its memory
        staging.free_all_blocks()


_transient: list = []  # the transient pools of the blocks open now, outermost first

ARENA_ALIGN = 512  # as CuPy's pool rounds a request


class Arena:
    """Buffers that live as long as the model (its resident weights) carved from one allocation of
    the engine's pool, made at the first request. The driver hands device memory out in 2 MiB pages
    per cudaMalloc, so a buffer a pool allocation of its own wastes up to 2 MiB that the pool does
    not count: measured ~300 MiB for the 8B's 300-odd weight buffers and ~420 MiB past the plan for
    the 70B's resident part at 24 GB (2026-12-03). A request past the arena's size goes to the pool."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.used = 0
        self._block: cupy.cuda.MemoryPointer | None = None

    def malloc(self, nbytes: int) -> cupy.cuda.MemoryPointer:
        start = -(-self.used // ARENA_ALIGN) * ARENA_ALIGN
        if start + nbytes > self.nbytes:
            return cupy.get_default_memory_pool().malloc(nbytes)
        if self._block is None:
            self._block = cupy.get_default_memory_pool().malloc(self.nbytes)
        self.used = start + nbytes
        block = self._block
        return cupy.cuda.MemoryPointer(block.mem, block.ptr - block.mem.ptr + start)


@contextmanager
def arena(nbytes: int, buffers: int = 0) -> Iterator[Arena]:
    """Allocations inside the block (but a transient_pool's) come from one Arena of nbytes plus the
    alignment of `buffers` requests; the memory goes back when the last of them is freed."""
    held = Arena(nbytes + ARENA_ALIGN * buffers)
    with cupy.cuda.using_allocator(held.malloc):
        yield held


class PeakMonitor:
    """The largest device memory in use (total - free, as the driver and nvidia-smi count it) while
    the block runs, sampled every `interval` seconds and at both ends."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval  # 0: no sampling thread, the two ends only
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vram-peak", daemon=True)

    def sample(self) -> int:
        free, total = device_memory()
        self.peak = max(self.peak, total - free)
        return total - free

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakMonitor:
        self.sample()
        if self.interval:
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self.interval:
            self._thread.join()
        cupy.cuda.Device().synchronize()
        self.sample()
