"""The logits of a verified token tree (GpuTransformer.verify_tree: one pass for all nodes, each
node's logits the bits plain decoding gets at its position after its path), fetched as a walk down
the tree needs them: a few rows of the hundreds verified, or every row's arg-max in one kernel."""

from __future__ import annotations

from collections.abc import Callable

import cupy
import numpy as np

from infer.gpu import ops
from infer.sampler import argmax_rows

F32 = cupy.float32


class TreeLogits:
    """The logits of a tree's nodes, fetched row by row (a walk down the tree reads a few rows of
    the hundreds verified). Rows on the device (the model's logits block: valid until its next pass,
    `current` says whether that came), or already on the host for very large trees."""

    def __init__(self, rows: cupy.ndarray | np.ndarray, stream: cupy.cuda.Stream,
                 current: Callable[[], bool] = lambda: True, spare: cupy.ndarray | None = None) -> None:
        """spare: unused rows of the same logits block (planned VRAM), the scratch of top_children."""
        self.rows, self.stream, self._current, self.spare = rows, stream, current, spare
        self.on_device = isinstance(rows, cupy.ndarray)

    def _check(self) -> None:
        if self.on_device and not self._current():
            raise RuntimeError("a token tree's logits were read after another pass of the model overwrote them "
                               "(fetch the rows needed, or to_host(), before the next pass)")

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)

    def __getitem__(self, node: int) -> np.ndarray:
        if not self.on_device:
            return self.rows[node]
        self._check()
        out = cupy.asnumpy(self.rows[node], stream=self.stream)
        self.stream.synchronize()
        return out

    def row_argmax(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, maxima, nonfinite) of every row: its arg-max as the decode step's sampler picks it
        (ties to the lowest id, NaN never chosen), that value, and its count of NaN and +inf. On the
        device one kernel and one small copy: a greedy walk reads these, not the rows it visits."""
        if not self.on_device:
            return argmax_rows(self.rows)
        self._check()
        n, vocab = self.rows.shape
        with self.stream:
            out = cupy.empty(3 * n, cupy.int32)  # ids, maxima (as float32 bits), nonfinite counts
            ops.argmax_rows(self.rows, n, vocab, out[:n], out[n : 2 * n].view(F32), out[2 * n :])
            host = cupy.asnumpy(out, stream=self.stream)
        self.stream.synchronize()
        return host[:n].astype(np.int64), host[n : 2 * n].view(np.float32), host[2 * n :]

    def top_children(self, nodes: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """((len(nodes), k) ids, log-probabilities) of each node's k most likely next tokens (ties to
        the lower id), computed on the device: one small copy instead of the nodes' rows."""
        from infer.draft_tree import top_children

        if not self.on_device:
            return top_children(self.rows, nodes, k)
        self._check()
        m = len(nodes)

        if self.spare is None or self.spare.shape[0] < 2 * m:
            # no planned room for the vocabulary-wide scratch: the rows to the host, one view at a time
            with self.stream:
                host = np.stack([cupy.asnumpy(self.rows[node], stream=self.stream) for node in nodes])
            self.stream.synchronize()
            return top_children(host, list(range(m)), k)
        with self.stream:
            idx = cupy.asarray(np.asarray(nodes, dtype=np.int64))
            # the nodes' rows and their exponentials in the block's spare rows (the plan counted the
            # block; vocabulary-wide temporaries it did not)
            spare = self.spare
            rows = self.rows.take(idx, axis=0, out=spare[:m])
            peak = rows.max(axis=1)
            scratch = spare[m : 2 * m]
            cupy.subtract(rows, peak[:, None], out=scratch)
            cupy.exp(scratch, out=scratch)
            logsum = peak + cupy.log(scratch.sum(axis=1))
            ids = ops.top_rows(rows, m, k)  # overwrites the copies
            logp = self.rows[idx[:, None], ids.astype(cupy.int64)] - logsum[:, None]
            ids_host, logp_host = cupy.asnumpy(ids, stream=self.stream), cupy.asnumpy(logp, stream=self.stream)
        self.stream.synchronize()
        return ids_host.astype(np.int64), logp_host.astype(np.float32)

    def to_host(self) -> np.ndarray:
        if not self.on_device:
            return self.rows
        self._check()
        out = cupy.asnumpy(self.rows, stream=self.stream)
        self.stream.synchronize()
        return out
