"""With ALLOC_TRACE_OUT=<dir> and this folder on PYTHONPATH, every Python process records each CuPy
pool allocation by its call site in infer/ and writes, at exit, the bytes and counts per site and the
pool's largest total to <dir>/<pid>.txt: for finding what a VRAM plan leaves out."""
import os

if os.environ.get("ALLOC_TRACE_OUT"):
    import atexit
    import collections
    import traceback

    import cupy

    _pool = cupy.get_default_memory_pool()
    _bytes: collections.Counter = collections.Counter()
    _count: collections.Counter = collections.Counter()
    _peak = [0]

    def _site() -> str:
        for f in reversed(traceback.extract_stack()[:-2]):
            if "/infer/" in f.filename:
                return f"{f.filename.split('/infer/')[-1]}:{f.lineno} {f.name}"
        return "?"

    def _malloc(n: int):  # noqa: ANN202
        s = _site()
        _bytes[s] += n
        _count[s] += 1
        try:
            return _pool.malloc(n)
        finally:
            _peak[0] = max(_peak[0], _pool.total_bytes())

    cupy.cuda.set_allocator(_malloc)

    def _report() -> None:
        lines = [f"pool peak total {_peak[0] / 2**20:.2f} MiB, limit {_pool.get_limit() / 2**20:.2f} MiB"]
        lines += [f"{_bytes[s] / 2**20:10.3f} MiB {_count[s]:7d}x  {s}" for s, _ in _bytes.most_common(40)]
        out = os.environ["ALLOC_TRACE_OUT"]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{os.getpid()}.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")

    atexit.register(_report)
