"""The logits of a verified token tree (GpuTransformer.verify_tree: one pass for all nodes, each
node's logits the bits plain decoding gets at its position after its path), fetched as a walk down
the tree needs them: a few rows of the hundreds verified, or every row's arg-max in one kernel."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import cupy
import numpy as np

from infer.gpu import ops
from infer.sampler import NonFiniteLogits, apply_logit_bias, argmax_rows

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
        # its GPU: a walk reads it after the pass, whatever GPU is current then (a pipeline's head)
        self.device_id = getattr(getattr(rows, "device", None), "id", 0)

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

    def row_argmax(self, bias: Sequence[tuple[int, float]] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, maxima, nonfinite) of every row: its arg-max as the decode step's sampler picks it
        (ties to the lowest id, NaN never chosen), that value, and its count of NaN and +inf. On the
        device one kernel and one small copy: a greedy walk reads these, not the rows it visits.
        bias: (token id, value) pairs added to every row first, as Sampler's logit_bias adds them
        (float32, in order; ignore_eos is one): on the device the rows are changed in place."""
        if not self.on_device:
            rows = self.rows
            if bias:
                rows = np.array(rows, np.float32, copy=True)
                for row in rows:
                    apply_logit_bias(row, bias)
            return argmax_rows(rows)
        self._check()
        n, vocab = self.rows.shape
        with cupy.cuda.Device(self.device_id), self.stream:
            pairs = [(token, value) for token, value in bias if 0 <= token < vocab]
            for at, token, value in _bias_rounds([(r, pairs) for r in range(n)] if pairs else []):
                self.rows[at, token] += value
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
            with cupy.cuda.Device(self.device_id), self.stream:
                host = np.stack([cupy.asnumpy(self.rows[node], stream=self.stream) for node in nodes])
            self.stream.synchronize()
            return top_children(host, list(range(m)), k)
        with cupy.cuda.Device(self.device_id), self.stream:
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


def greedy_choices(rows: cupy.ndarray | np.ndarray, stream: cupy.cuda.Stream,
                   bias: Sequence[tuple[int, Sequence[tuple[int, float]]]] = ()) -> list[tuple[int, float]]:
    """Each row's greedy choice and its value, on the device when the rows are there (one kernel and
    a copy of 12 bytes a row): the arg-max of the logits with `bias` added first ((row, (token id,
    value) pairs): float32 sums in the pairs' order, Sampler's logit_bias), ties to the lowest id.
    -inf means every token is excluded. NaN or +inf in a row: NonFiniteLogits, as the host's sampler.
    The rows are changed in place by the bias (a pass's scratch)."""
    if isinstance(rows, np.ndarray):
        for row, pairs in bias:
            apply_logit_bias(rows[row], pairs)
        ids, maxima, nonfinite = argmax_rows(rows)
    else:
        with stream:
            for at, token, value in _bias_rounds(bias):  # a round adds one value to each (row, id) at most
                rows[at, token] += value
        ids, maxima, nonfinite = TreeLogits(rows, stream).row_argmax()
    if nonfinite.any():
        bad = int(np.flatnonzero(nonfinite)[0])
        raise NonFiniteLogits(rows[bad] if isinstance(rows, np.ndarray) else cupy.asnumpy(rows[bad]))
    return [(int(i), float(v)) for i, v in zip(ids, maxima, strict=True)]


def _bias_rounds(bias: Sequence[tuple[int, Sequence[tuple[int, float]]]]
                 ) -> list[tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]]:
    """The bias pairs as rounds of (rows, ids, float32 values) with no (row, id) twice in a round, in
    the pairs' order: an index-add does not accumulate repeats, and the host adds them one by one."""
    rounds: list[list[tuple[int, int, float]]] = []
    seen: dict[tuple[int, int], int] = {}
    for row, pairs in bias:
        for token, value in pairs:
            k = seen.get((row, token), 0)
            seen[(row, token)] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append((row, token, value))
    return [(cupy.asarray([r for r, _, _ in pairs], cupy.int64), cupy.asarray([t for _, t, _ in pairs], cupy.int64),
             cupy.asarray(np.array([v for _, _, v in pairs], np.float32))) for pairs in rounds]
