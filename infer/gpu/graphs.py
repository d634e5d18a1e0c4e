"""CUDA graphs of a pass's launches, captured once per key (a segment of layers and a row bucket) and
replayed: a pass of a few hundred small kernels costs the GPU's time, not Python's."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import cupy

from infer.gpu import pdl


class GraphCache:
    """Graphs by key on one stream. A graph is captured again when the addresses it was captured
    with change (a streamed layer's matrices in a scratch that moved)."""

    def __init__(self, stream: cupy.cuda.Stream) -> None:
        self.stream = stream
        self._graphs: dict[Hashable, tuple[object, tuple[int, ...] | None]] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def replay(self, key: Hashable, addresses: tuple[int, ...] | None, launches: Callable[[], object]) -> None:
        """Replays the graph of `launches` kept under `key`, capturing it first if it is missing or
        was captured with other `addresses`. `launches` must not allocate or synchronise."""
        kept = self._graphs.get(key)
        if kept is None or kept[1] != addresses:
            self.stream.begin_capture()
            try:
                with pdl.capturing():  # the pass's kernels wait for their predecessor on the GPU
                    launches()
            finally:
                graph = self.stream.end_capture()
            kept = self._graphs[key] = (graph, addresses)
        kept[0].launch(self.stream)  # type: ignore[attr-defined]

    def drop(self, kind: str) -> None:
        """Forgets the graphs whose key starts with `kind` (their buffers were made anew)."""
        for key in [k for k in self._graphs if isinstance(k, tuple) and k and k[0] == kind]:
            del self._graphs[key]
