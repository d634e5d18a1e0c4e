"""Where a Python process's threads spend their time: every millisecond the stack of each thread is
sampled (sys._current_frames) and counted per function, inclusive and at the top; the table is
written at exit. For the server's host path (the scheduler thread against the event loop's), where
cProfile sees one thread and no wait.

    python scripts/py_sampler.py OUT.txt infer.cli:main serve -m model.gguf ...   # SIGINT to stop
"""

from __future__ import annotations

import atexit
import collections
import importlib
import os
import sys
import threading
import time


def main() -> None:
    if len(sys.argv) < 3 or ":" not in sys.argv[2]:
        raise SystemExit("usage: py_sampler.py OUT.txt module:function [args...]")
    out, target, *rest = sys.argv[1:]
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    top: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: collections.Counter = collections.Counter()
    me = threading.get_ident()

    def sample() -> None:
        while True:
            time.sleep(0.001)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me_sampler[0]:
                    continue
                name = "main" if ident == me else names.get(ident, str(ident))
                samples[name] += 1
                seen = set()
                f = frame
                first = True
                while f is not None:
                    code = f.f_code
                    key = f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}"
                    if first:
                        top[name][f"{key}:{f.f_lineno}"] += 1
                        first = False
                    if key not in seen:
                        inclusive[name][key] += 1
                        seen.add(key)
                    f = f.f_back

    me_sampler = [0]

    def dump() -> None:
        with open(out, "w") as fh:
            for name, n in samples.most_common():
                fh.write(f"== thread {name}: {n} samples\n-- inclusive\n")
                for key, c in inclusive[name].most_common(45):
                    fh.write(f"{100 * c / n:6.1f}%  {key}\n")
                fh.write("-- at the top\n")
                for key, c in top[name].most_common(25):
                    fh.write(f"{100 * c / n:6.1f}%  {key}\n")

    atexit.register(dump)
    thread = threading.Thread(target=sample, name="sampler", daemon=True)
    thread.start()
    me_sampler[0] = thread.ident
    sys.argv = [target, *rest]
    sys.path.insert(0, os.getcwd())
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)()


if __name__ == "__main__":
    main()
