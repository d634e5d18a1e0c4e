"""Chat: the GGUF file's chat template, rendered with jinja2, and a conversation that keeps its history.

`tokenizer.chat_template` is a Jinja template written for Hugging Face transformers; it is rendered
the way transformers and llama-cpp-python render it (sandboxed, trim_blocks/lstrip_blocks, loop
controls, `raise_exception`, a `tojson` that keeps non-ASCII text). A file without a template gets
its architecture's turn format where that is fixed (Gemma: llama.cpp's built-in "gemma" format), and
ChatML with a warning otherwise.

`ChatSession` feeds the model only what is new: after a reply, the next user turn renders the whole
conversation again and hands back the part after what the model has already seen.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from infer.tokenizer import Tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma's turns, as llama.cpp's built-in "gemma" format writes them: the assistant is "model", system
# text (trimmed) opens the next non-model turn, each turn's content trimmed. No BOS in the text: the
# tokenizer adds it (the files ask for it).
GEMMA_TEMPLATE = (
    "{% set pending = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set pending.system = pending.system + message['content'] | trim %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if pending.system and role != 'model' %}{{ pending.system + '\n\n' }}{% set pending.system = '' %}{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Architectures whose files may lack tokenizer.chat_template but whose turn format is fixed.
ARCHITECTURE_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The chat template cannot be compiled or rendered. `str(err)` is one line."""


class ChatTemplateWarning(UserWarning):
    """The model has no chat template of its own; ChatML is used instead."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", is_fallback: bool = False) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_fallback = is_fallback
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"chat template does not compile (line {err.lineno}): {err.message}") from None

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tokenizer: Tokenizer) -> ChatTemplate:
        """The file's `tokenizer.chat_template`; without one its architecture's fixed turn format
        (ARCHITECTURE_TEMPLATES), or else ChatML with a ChatTemplateWarning."""
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        source = metadata.get("tokenizer.chat_template")
        if not source and metadata.get("general.architecture") in ARCHITECTURE_TEMPLATES:
            return cls(ARCHITECTURE_TEMPLATES[metadata["general.architecture"]], bos, eos)
        if not source:
            warnings.warn("the model has no chat template (tokenizer.chat_template); using ChatML",
                          ChatTemplateWarning, stacklevel=2)
            return cls(CHATML_TEMPLATE, bos, eos, is_fallback=True)
        if not isinstance(source, str):
            raise ChatTemplateError(f"tokenizer.chat_template must be a string, not {type(source).__name__}")
        return cls(source, bos, eos)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The conversation as prompt text. `extra` reaches the template too (e.g. tools=[...])."""
        import jinja2

        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ChatTemplateError(f"message {i} needs 'role' and 'content'")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as err:
            first_line = (str(err).splitlines() or [type(err).__name__])[0]
            raise ChatTemplateError(f"chat template failed: {first_line}") from None


@dataclass(frozen=True)
class PromptUpdate:
    """What to feed the model for a new turn. `restart`: `text` is the whole conversation and the
    model's cache must be emptied first (the template rewrote earlier turns)."""

    text: str
    restart: bool


@dataclass
class ChatSession:
    """A conversation: `add_user` -> feed `tokens(update)` -> generate until `is_end_of_turn` ->
    `add_assistant(reply)` -> `add_user` ..."""

    template: ChatTemplate
    tokenizer: Tokenizer
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    # the text the model has processed so far (prompts and its own replies)
    _seen: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        if self.system is not None and not self.messages:
            self.messages.append({"role": "system", "content": self.system})

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end the assistant's turn (EOS, EOT and the other end-of-generation tokens)."""
        return self.tokenizer.eot_ids

    def is_end_of_turn(self, token_id: int) -> bool:
        return token_id in self.stop_ids

    def add_user(self, content: str) -> PromptUpdate:
        self.messages.append({"role": "user", "content": content})
        full = self.template.render(self.messages, add_generation_prompt=True)
        restart = not full.startswith(self._seen) or not self._seen
        update = PromptUpdate(text=full if restart else full[len(self._seen):], restart=restart)
        self._seen = full
        return update

    def add_assistant(self, reply: str, raw: str | None = None) -> None:
        """Record the reply (without its end-of-turn token, which the model never saw); `raw`: the
        text as the model wrote it, when the reply kept only its answer (a reasoning model's)."""
        self.messages.append({"role": "assistant", "content": reply})
        self._seen += reply if raw is None else raw

    def tokens(self, update: PromptUpdate) -> list[int]:
        """Token ids for `update`, with special tokens parsed. BOS is added at a restart when the file
        asks for it, unless the template already wrote it."""
        add_bos = False
        if update.restart and self.tokenizer.vocab.add_bos:
            add_bos = not (self.template.bos_token and update.text.startswith(self.template.bos_token))
        return self.tokenizer.encode(update.text, add_bos=add_bos, special=True)

    def full_prompt(self, add_generation_prompt: bool = True) -> str:
        return self.template.render(self.messages, add_generation_prompt=add_generation_prompt)
