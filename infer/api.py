"""The Python API: load a GGUF model, tokenize, generate, score, chat.

    from infer.api import LLM
    llm = LLM.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    for piece in llm.generate("The capital of France is", max_tokens=16, temperature=0):
        print(piece.text, end="", flush=True)

Errors in the model file raise infer.errors.ModelError (one line naming the file and the problem).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infer.arch import ModelArgs
from infer.chat import ChatSession, ChatTemplate
from infer.engine import ContextFullError, Engine, GenerationStats, Model
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.perplexity import PerplexityResult, perplexity
from infer.reasoning import ReplySplitter, reasoning_format
from infer.sampler import Sampler, SamplerConfig
from infer.scheduler import Request, Scheduler, common_prefix
from infer.tokenizer import StreamDecoder, Tokenizer

DEFAULT_CTX = 4096


@dataclass(frozen=True)
class Token:
    """One generated token: its id and the text it completes (may be '' inside a UTF-8 sequence)."""

    id: int
    text: str


def _sampler_config(temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                    repeat_last_n: int, seed: int | None) -> SamplerConfig:
    return SamplerConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)


class LLM:
    """A loaded model with its tokenizer and one sequence (KV cache), on the CPU or the GPU."""

    def __init__(self, gguf: GGUFModel, transformer: Model, tokenizer: Tokenizer, ctx_size: int) -> None:
        self.gguf = gguf
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.engine = Engine(transformer, ctx_size)  # the one KV cache, and scoring (logits, perplexity)
        # generation is a request to the generation loop, on that cache
        self._scheduler = Scheduler(transformer, ctx_size, 1, caches=[self.engine.cache], prefix_cache=False)

    @classmethod
    def load(cls, path: str | Path, ctx_size: int | None = None, device: str = "cpu",
             weight_budget_bytes: int = 8 << 30, exact: bool = False, vram_budget: str | int | None = None,
             enforce_budget: bool = False, planned: dict[str, int] | None = None, tree_nodes: int = 0,
             progress: Callable[[int, int], None] | None = None, experts: str | int = "auto",
             expert_stream: str | int = "auto", gpus: Sequence[int] | None = None) -> LLM:
        """Opens and checks `path`. ctx_size: tokens of context (default: the model's, at most 4096).
        device: "cpu", "gpu" (CuPy; a ValueError when no GPU is visible) or "auto" (GPU if present).
        exact: on the CPU, float64 sums (infer.model).
        vram_budget (GPU): device memory the engine may use (default: the free memory less a margin);
        a model that does not fit raises infer.tiers.budget.VramBudgetError. enforce_budget: cap the
        device memory pool at it (process-wide). planned, tree_nodes, progress (the GPU upload's
        progress(done, total)) and experts (a mixture of experts on the GPU: "auto", "gpu", "cpu" or
        a count of blocks whose experts the CPU computes) and expert_stream (those blocks' experts
        streamed to the GPU for long prompts and shared per pick in decode: "auto", "off" or N rows):
        see load_gpu_transformer. gpus (device "gpu"): the layers split across these GPUs, each a stage
        (infer.gpu.stages.load_gpu_stages); vram_budget then one size for each GPU or one per GPU
        ("24GB,20GB")."""
        from infer.gpu import resolve_device

        where = resolve_device(device)  # ValueError with one line for 'gpu' without a GPU
        gguf = GGUFModel(path)
        ModelArgs.from_gguf(gguf)  # an architecture we cannot run is the error, not its tokenizer
        tokenizer = Tokenizer.from_gguf(gguf.metadata)
        transformer: Model
        if where == "gpu" and gpus:
            from infer.gpu.stages import load_gpu_stages
            from infer.tiers.stage_plan import parse_budgets

            budgets = parse_budgets(None if vram_budget is None else str(vram_budget), len(gpus))
            transformer = load_gpu_stages(gguf, gpus, budgets, ctx_size, tree_nodes=tree_nodes, progress=progress,
                                          enforce_budget=enforce_budget, planned=planned, experts=experts,
                                          expert_stream=expert_stream)
        elif where == "gpu":
            from infer.gpu import load_gpu_transformer

            transformer = load_gpu_transformer(gguf, ctx_size, vram_budget, enforce_budget=enforce_budget,
                                               planned=planned, tree_nodes=tree_nodes, progress=progress,
                                               experts=experts, expert_stream=expert_stream)
        else:
            transformer = load_transformer(gguf, weight_budget_bytes, exact=exact)
        ctx = ctx_size or min(transformer.args.context_length, DEFAULT_CTX)
        return cls(gguf, transformer, tokenizer, ctx)

    @property
    def args(self) -> ModelArgs:
        return self.transformer.args

    @property
    def stats(self) -> GenerationStats:
        """Counts and timings of the last generate() call."""
        return self.engine.stats

    # --- text <-> ids ------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`; add_bos None follows the file, special parses '<|im_start|>' etc."""
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def _ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    # --- scoring -----------------------------------------------------------------------------------

    def logits(self, prompt: str | Sequence[int]) -> np.ndarray:
        """(T, vocab) float32 logits of every prompt position, evaluated from an empty context."""
        self.engine.reset()
        return self.engine.evaluate(self._ids(prompt), all_logits=True)

    def perplexity(self, text: str | Sequence[int], ctx: int = 256, max_chunks: int | None = None) -> PerplexityResult:
        """llama.cpp-style perplexity of `text` (see infer.perplexity)."""
        tokens = self._ids(text)
        bos = self.tokenizer.bos_id if self.tokenizer.vocab.add_bos else None
        return perplexity(tokens, ctx, self.logits, bos_id=bos, max_chunks=max_chunks)

    # --- generation --------------------------------------------------------------------------------

    def generate_ids(self, prompt: str | Sequence[int], max_tokens: int = 128, sampler: SamplerConfig | None = None,
                     stop_at_eog: bool = True, reuse_cache: bool = False) -> Iterator[int]:
        """Token ids after `prompt` (an end-of-generation id is yielded, then generation stops), as
        a request to the generation loop (infer.scheduler) on this model's one KV cache.

        reuse_cache: keep the keys/values of the prefix this prompt shares with the sequence
        already in the cache (what chat turns do). Off by default so that a call gives the same
        result every time: with quantized weights, logits depend slightly on how a prompt is
        split into batches, as in llama.cpp."""
        ids = self._ids(prompt)
        if not ids:
            raise ValueError("the prompt has no tokens")
        if len(ids) > self.engine.ctx_size:
            raise ContextFullError(f"a prompt of {len(ids)} tokens exceeds the context size {self.engine.ctx_size} "
                                   "(raise -c/--ctx-size)")
        shared = 0
        if reuse_cache:  # the last prompt token always runs: its logits are needed
            shared = common_prefix(self.engine.tokens, ids, len(ids) - 1)
        stop = self.tokenizer.vocab.eog_ids if stop_at_eog else frozenset()
        request = Request(ids, max_tokens, Sampler(sampler or SamplerConfig(temperature=0.0)), stop_ids=stop)
        return self._run(request, shared)

    def _run(self, request: Request, shared: int) -> Iterator[int]:
        engine, run = self.engine, self._scheduler.stats
        seconds_before, prompt_seconds_before = run.pass_seconds, run.prompt_pass_seconds
        engine.stats = stats = GenerationStats(stop_reason="length")
        cache = engine.cache
        chosen: list[int] = []
        try:
            for token in self._scheduler.run_one(request, shared):
                chosen.append(token)
                stats.generated_tokens = len(chosen)
                yield token
        finally:  # the cache holds the prompt and every chosen token but the last
            engine.tokens = (request.prompt + chosen)[: cache.length]
            stats.prompt_tokens = len(request.prompt) - min(shared, cache.length)
            stats.prompt_seconds = run.prompt_pass_seconds - prompt_seconds_before
            stats.decode_seconds = run.pass_seconds - seconds_before - stats.prompt_seconds
            if request.finish_reason == "stop":
                stats.stop_reason = "eog"
            elif request.finish_reason == "length" and len(request.generated) < request.max_tokens:
                stats.stop_reason = "context"

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, seed: int | None = None, stop_at_eog: bool = True) -> Iterator[Token]:
        """Tokens with their text as they are generated; temperature 0 is greedy. The final
        end-of-generation token, if any, is not yielded."""
        config = _sampler_config(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
        decoder = StreamDecoder(self.tokenizer)
        for token in self.generate_ids(prompt, max_tokens, config, stop_at_eog):
            if stop_at_eog and self.tokenizer.is_eog(token):
                break
            yield Token(token, decoder.push(token))
        tail = decoder.flush()
        if tail:
            yield Token(-1, tail)  # bytes of an unfinished UTF-8 sequence at the end (as U+FFFD)

    def complete(self, prompt: str | Sequence[int], max_tokens: int = 128, **sampling: object) -> str:
        """The generated text after `prompt`, as one string."""
        return "".join(t.text for t in self.generate(prompt, max_tokens, **sampling))  # type: ignore[arg-type]

    def chat(self, system: str | None = None) -> Chat:
        """A conversation using the model's chat template (history kept across turns)."""
        template = ChatTemplate.from_gguf(self.gguf.metadata, self.tokenizer)
        return Chat(self, ChatSession(template, self.tokenizer, system=system))


class Chat:
    """Turns of a conversation: `send(message)` yields the reply's text pieces as they come. A
    reasoning model's thinking (infer.reasoning: gpt-oss's analysis channel, <think> tags) is not
    among them: it goes to `send`'s on_reasoning, and the history keeps the answer."""

    def __init__(self, llm: LLM, session: ChatSession) -> None:
        self.llm = llm
        self.session = session
        self._history: list[int] = []  # every token of the conversation so far
        self.reply_form = reasoning_format(session.template.source, session.tokenizer)

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.session.messages

    def send(self, message: str, max_tokens: int = 512, sampler: SamplerConfig | None = None,
             on_reasoning: Callable[[str], None] | None = None) -> Iterator[str]:
        update = self.session.add_user(message)
        new_ids = self.session.tokens(update)
        # The prompt is the whole conversation as generated (not re-tokenized); the engine's cache
        # holds its prefix, so prefill only runs this turn's tokens.
        prompt = new_ids if update.restart else self._history + new_ids
        form = self.reply_form
        decoder = StreamDecoder(self.llm.tokenizer, special=form == "harmony")  # harmony's markers: control tokens
        splitter = ReplySplitter(form, form == "think" and update.text.rstrip().endswith("<think>")) if form else None
        reply_ids: list[int] = []
        raw: list[str] = []  # the reply as the model wrote it
        answer: list[str] = []

        def take(text: str, last: bool = False) -> str:
            raw.append(text)
            if splitter is None:
                answer.append(text)
                return text
            reasoning, content = splitter.push(text)
            if last:
                more = splitter.flush()
                reasoning, content = reasoning + more[0], content + more[1]
            if reasoning and on_reasoning is not None:
                on_reasoning(reasoning)
            answer.append(content)
            return content

        flushed = False
        try:
            for token in self.llm.generate_ids(prompt, max_tokens, sampler, reuse_cache=True):
                if self.session.is_end_of_turn(token):
                    break
                reply_ids.append(token)
                piece = take(decoder.push(token))
                if piece:
                    yield piece
            flushed = True
            piece = take(decoder.flush(), last=True)
            if piece:
                yield piece
        finally:  # also a reply cut short (Ctrl-C, the generator closed): the conversation keeps what was said
            if not flushed:
                take(decoder.flush(), last=True)
            self._history = prompt + reply_ids
            self.session.add_assistant("".join(answer), raw="".join(raw))

    def ask(self, message: str, max_tokens: int = 512, sampler: SamplerConfig | None = None) -> str:
        return "".join(self.send(message, max_tokens, sampler))
