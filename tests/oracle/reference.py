"""llama.cpp (through llama-cpp-python) evaluated the way the tests compare: a whole prompt as one
batch, then one token at a time, from an empty context each time."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """llama.cpp logs model loading to fd 2 even with verbose=False; keep test output readable."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Reference:
    """One GGUF file loaded in llama.cpp with a context of `n_ctx` tokens (batch = n_ctx)."""

    def __init__(self, path: Path, n_ctx: int = 512, n_threads: int = 2) -> None:
        import llama_cpp

        with _quiet_stderr():
            self.llm = llama_cpp.Llama(
                model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=n_threads, n_threads_batch=n_threads, flash_attn=False, verbose=False,
            )
        self.n_ctx = n_ctx

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """add_bos=True adds BOS only where the file asks for it (llama.cpp's add_special)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """(T, vocab) logits of the whole sequence evaluated as one batch from an empty context."""
        self.llm.reset()
        self.llm.eval(list(ids))
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def logits_token_by_token(self, ids: Sequence[int]) -> np.ndarray:
        """(T, vocab) logits with every token evaluated as its own batch."""
        self.llm.reset()
        rows = []
        for token in ids:
            self.llm.eval([token])
            rows.append(np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32))
        return np.stack(rows)

    def greedy(self, prompt: Sequence[int], n: int) -> tuple[list[int], np.ndarray]:
        """n greedy ids after `prompt` (prompt as one batch, then one token per step) and the (n, vocab)
        logits each was chosen from."""
        logits = self.logits(prompt)[-1]
        out: list[int] = []
        rows = []
        for _ in range(n):
            rows.append(logits)
            token = int(np.argmax(logits))
            out.append(token)
            self.llm.eval([token])
            logits = np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float32)
        return out, np.stack(rows)

    def close(self) -> None:
        self.llm.close()
