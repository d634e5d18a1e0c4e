"""Chat templates of the real models (against llama-cpp-python's formatter and llama.cpp's own
ChatML), conversation history, and template errors."""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import pytest

from infer.chat import ChatSession, ChatTemplate, ChatTemplateError, ChatTemplateWarning
from infer.tokenizer import Tokenizer
from tests.infer.test_tokenizer_models import _required_or_skip, read_metadata
from tests.oracle.assets import gemma3_path, qwen05b_path, smollm2_path

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # its template's default
CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a colour, ünïcode 🦙."},
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[dict[str, Any], Tokenizer]:
    metadata = read_metadata(_required_or_skip(smollm2_path()))
    return metadata, Tokenizer.from_gguf(metadata)


@pytest.fixture(scope="module")
def qwen() -> tuple[dict[str, Any], Tokenizer]:
    metadata = read_metadata(_required_or_skip(qwen05b_path()))
    return metadata, Tokenizer.from_gguf(metadata)


@pytest.fixture(scope="module")
def gemma3() -> tuple[dict[str, Any], Tokenizer]:
    metadata = read_metadata(_required_or_skip(gemma3_path()))
    return metadata, Tokenizer.from_gguf(metadata)


def _builtin(name: bytes, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """llama.cpp's own formatting of `messages` by its built-in template `name`."""
    import llama_cpp

    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(
        *(llama_cpp.llama_chat_message(role=r, content=c) for r, c in keep)
    )
    buffer = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_chat_apply_template(name, chat, len(keep), add_generation_prompt, buffer, len(buffer))
    assert 0 < n <= len(buffer)
    return buffer.raw[:n].decode()


def _chatml(messages: list[dict[str, str]], generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def test_smollm2_template_renders_chatml_with_its_default_system_turn(smollm2: tuple[dict, Tokenizer]) -> None:
    template = ChatTemplate.from_gguf(*smollm2)
    assert not template.is_fallback
    expected = _chatml([{"role": "system", "content": SMOLLM2_SYSTEM}, *CONVERSATION], True)
    assert template.render(CONVERSATION) == expected
    assert template.render(CONVERSATION, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


@pytest.mark.oracle
@pytest.mark.parametrize("which", ["smollm2", "qwen"])
def test_templates_render_like_llama_cpp_python(which: str, request: pytest.FixtureRequest) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    metadata, tokenizer = request.getfixturevalue(which)
    ours = ChatTemplate.from_gguf(metadata, tokenizer)
    theirs = Jinja2ChatFormatter(
        metadata["tokenizer.chat_template"], eos_token=ours.eos_token, bos_token=ours.bos_token
    )
    for messages in (CONVERSATION[:1], CONVERSATION, [{"role": "system", "content": "Be brief."}, *CONVERSATION]):
        assert ours.render(messages) == theirs(messages=messages).prompt


@pytest.mark.oracle
def test_smollm2_template_renders_like_llama_cpp_builtin_chatml(smollm2: tuple[dict, Tokenizer]) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    assert ChatTemplate.from_gguf(*smollm2).render(messages) == _builtin(b"chatml", messages)


@pytest.mark.oracle
def test_gemma3_without_a_template_gets_gemmas_turns_like_llama_cpp(gemma3: tuple[dict, Tokenizer]) -> None:
    """The Gemma 3 270M file carries no chat template: its turns are llama.cpp's built-in "gemma"
    format (system text inside the first user turn, the assistant as "model", contents trimmed)."""
    metadata, tokenizer = gemma3
    assert "tokenizer.chat_template" not in metadata
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ChatML fallback warning
        template = ChatTemplate.from_gguf(metadata, tokenizer)
    assert not template.is_fallback
    padded = [{"role": "user", "content": "  spaced out \n"}, {"role": "assistant", "content": "\nok "}]
    for messages in (CONVERSATION[:1], CONVERSATION, [{"role": "system", "content": " Be brief. "}, *CONVERSATION],
                     padded + [{"role": "system", "content": "Late system."}, {"role": "user", "content": "again"}]):
        for prompt in (True, False):
            assert template.render(messages, add_generation_prompt=prompt) == _builtin(b"gemma", messages, prompt)
    session = ChatSession(template, tokenizer, system="Be brief.")
    ids = session.tokens(session.add_user("Hi"))
    assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.bos_id) == 1
    assert tokenizer.decode_bytes(ids[1:], special=True).decode() == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    end_of_turn = tokenizer.encode("<end_of_turn>", add_bos=False, special=True)
    assert len(end_of_turn) == 1 and session.is_end_of_turn(end_of_turn[0])


def test_session_keeps_history_and_feeds_only_the_new_part(smollm2: tuple[dict, Tokenizer]) -> None:
    metadata, tokenizer = smollm2
    session = ChatSession(ChatTemplate.from_gguf(metadata, tokenizer), tokenizer)
    first = session.add_user("Hi there")
    assert first.restart and first.text == _chatml(
        [{"role": "system", "content": SMOLLM2_SYSTEM}, {"role": "user", "content": "Hi there"}], True
    )
    fed = session.tokens(first)
    reply = "Hello! How can I help?"
    fed += tokenizer.encode(reply, add_bos=False, special=False)  # what the model generated
    session.add_assistant(reply)

    second = session.add_user("Name a colour, ünïcode 🦙.")
    assert not second.restart
    assert second.text == "<|im_end|>\n<|im_start|>user\nName a colour, ünïcode 🦙.<|im_end|>\n<|im_start|>assistant\n"
    fed += session.tokens(second)
    assert session.messages == [{"role": "user", "content": "Hi there"}, *CONVERSATION[1:]]
    # piecewise feeding gives exactly the tokens of the whole conversation
    assert fed == tokenizer.encode(session.full_prompt(), add_bos=False, special=True)
    im_end = tokenizer.encode("<|im_end|>", add_bos=False, special=True)
    assert len(im_end) == 1 and session.is_end_of_turn(im_end[0])
    assert session.stop_ids == tokenizer.eot_ids and tokenizer.eos_id in session.stop_ids


def test_session_with_system_prompt(qwen: tuple[dict, Tokenizer]) -> None:
    metadata, tokenizer = qwen
    session = ChatSession(ChatTemplate.from_gguf(metadata, tokenizer), tokenizer, system="Answer in French.")
    update = session.add_user("Hello")
    assert update.text == _chatml(
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}], True
    )


def test_template_that_rewrites_history_restarts_the_prompt(smollm2: tuple[dict, Tokenizer]) -> None:
    _, tokenizer = smollm2
    last_only = ChatTemplate("{{ messages[-1]['role'] }}: {{ messages[-1]['content'] }}\n")
    session = ChatSession(last_only, tokenizer)
    session.add_user("one")
    session.add_assistant("reply")
    update = session.add_user("two")
    # (jinja drops the template's final newline, as transformers and llama-cpp-python do)
    assert update.restart and update.text == "user: two"


def test_bos_and_eos_variables_come_from_the_tokenizer(qwen: tuple[dict, Tokenizer]) -> None:
    metadata, tokenizer = qwen
    template = ChatTemplate.from_gguf(
        {**metadata, "tokenizer.chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"}, tokenizer
    )
    assert template.render([{"role": "user", "content": "x"}]) == "<|endoftext|>x<|im_end|>"


def test_missing_template_falls_back_to_chatml_with_a_warning(smollm2: tuple[dict, Tokenizer]) -> None:
    metadata, tokenizer = smollm2
    without = {k: v for k, v in metadata.items() if k != "tokenizer.chat_template"}
    with pytest.warns(ChatTemplateWarning, match="ChatML"):
        template = ChatTemplate.from_gguf(without, tokenizer)
    assert template.is_fallback
    assert template.render(CONVERSATION) == _chatml(CONVERSATION, True)


def test_raise_exception_in_template_is_one_line_error() -> None:
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first must be user") as err:
        template.render([{"role": "assistant", "content": "x"}])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "source, messages, match",
    [
        ("{% for m in messages %}", [], "does not compile"),
        ("{{ messages[5]['content'] }}", [{"role": "user", "content": "x"}], "failed"),
        ("{{ x }}", [{"role": "user"}], "needs 'role' and 'content'"),
        ("{{ ''.__class__.__mro__ }}", [], "failed"),  # the sandbox refuses attribute escapes
    ],
)
def test_bad_templates_give_one_line_errors(source: str, messages: list, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match) as err:
        ChatTemplate(source).render(messages)
    assert "\n" not in str(err.value)
