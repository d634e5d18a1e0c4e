"""A chat reply split into reasoning and answer (infer.reasoning): gpt-oss's harmony messages and
think tags, whole and piece by piece at every cut, with tool calls and unfinished replies."""

from __future__ import annotations

import numpy as np
import pytest

from infer.reasoning import ReplySplitter, reasoning_format
from infer.tokenizer import StreamDecoder, Tokenizer
from tests.infer.test_tokenizer import _id, _with_specials

HARMONY = ("<|channel|>analysis<|message|>The user asks for 2+2. <|x|> is not a marker.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>It is 4.")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")
THINK = "<think>\nAdd them: 2 + 2.\n</think>\n\nIt is 4."


def streamed(form: str, text: str, cuts: list[int], opened: bool = False) -> tuple[str, str, ReplySplitter]:
    splitter, reasoning, answer = ReplySplitter(form, opened), [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, t = splitter.push(text[a:b])
        reasoning.append(r)
        answer.append(t)
    r, t = splitter.flush()
    return "".join([*reasoning, r]), "".join([*answer, t]), splitter


@pytest.mark.parametrize(("form", "text", "want"), [
    ("harmony", HARMONY, ("The user asks for 2+2. <|x|> is not a marker.", "It is 4.")),
    ("harmony", "Just text, no header.", ("", "Just text, no header.")),
    ("harmony", "<|channel|>analysis<|message|>thinking, then cut off", ("thinking, then cut off", "")),
    ("harmony", "<|channel|>analysis<|message|>done<|end|><|start|>assistant<|chan", ("done", "")),
    ("harmony", "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>final<|message|>Yes.",
     ("", "Let me look.Yes.")),
    ("think", THINK, ("Add them: 2 + 2.\n", "It is 4.")),
    ("think", "  No tags at all.", ("", "  No tags at all.")),
    ("think", "<think>\nstill thinking when cut", ("still thinking when cut", "")),
    ("think", "It is <think> not at the start.", ("", "It is <think> not at the start.")),
], ids=["harmony", "harmony-plain", "harmony-cut-body", "harmony-cut-header", "harmony-commentary", "think",
        "think-none", "think-cut", "think-late"])
def test_a_reply_splits_alike_whole_and_in_every_piece_size(form: str, text: str, want: tuple[str, str]) -> None:
    """Whole, one character at a time, and at random cuts: the same reasoning and answer (so no piece
    of a marker came out: the expected texts hold none)."""
    assert ReplySplitter(form).split(text) == want
    assert streamed(form, text, list(range(1, len(text))))[:2] == want
    rng = np.random.default_rng(0)
    for _ in range(50):
        cuts = sorted(set(rng.integers(1, len(text), rng.integers(1, 6)).tolist()))
        assert streamed(form, text, cuts)[:2] == want, cuts


def test_a_template_that_opens_the_thinking_starts_the_reply_inside_it() -> None:
    assert ReplySplitter("think", opened=True).split("\nworking\n</think>\n\nanswer") == ("working\n", "answer")


def test_a_harmony_commentary_message_to_a_function_is_a_tool_call() -> None:
    for cuts in ([], list(range(1, len(CALL)))):
        reasoning, answer, splitter = streamed("harmony", CALL, cuts)
        assert (reasoning, answer) == ("Need the weather.", "")
        assert [(c.name, c.arguments) for c in splitter.calls] == [("get_weather", '{"city": "Paris"}')]


def test_the_form_is_read_from_the_template_and_the_vocabulary() -> None:
    """harmony needs its four markers as tokens and a template that writes channels; think tags
    need both tags as tokens and a template that writes them; otherwise the reply is left whole."""
    harmony = Tokenizer.from_gguf(_with_specials(["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]))
    assert reasoning_format("...<|start|>assistant<|channel|>final<|message|>...", harmony) == "harmony"
    assert reasoning_format("{{ messages }}", harmony) is None
    think = Tokenizer.from_gguf(_with_specials(["<|start|>", "<think>", "</think>"]))
    assert reasoning_format("{{ '<think>' }}...{{ '</think>' }}", think) == "think"
    assert reasoning_format("{{ '<think>' }}...{{ '</think>' }}", harmony) is None  # tags as plain text
    with pytest.raises(ValueError, match="unknown reply form"):
        ReplySplitter("other")


def test_harmony_markers_come_through_a_decoder_that_writes_control_tokens() -> None:
    """The markers are control tokens: decoded without `special` they vanish (and the split could not
    see them), decoded with it they are there for the splitter."""
    tokenizer = Tokenizer.from_gguf(_with_specials(["<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                                    "<|return|>", "<|call|>"]))
    ids = [_id(tokenizer, "<|channel|>"), *tokenizer.encode("hell", add_bos=False), _id(tokenizer, "<|message|>"),
           *tokenizer.encode("hello", add_bos=False), _id(tokenizer, "<|end|>")]
    plain, special = StreamDecoder(tokenizer), StreamDecoder(tokenizer, special=True)
    assert "".join(plain.push(i) for i in ids) == "hellhello<|end|>"  # <|end|>: user-defined text
    text = "".join(special.push(i) for i in ids)
    assert text == "<|channel|>hell<|message|>hello<|end|>"
    assert ReplySplitter("harmony").split(text) == ("", "hello")


@pytest.mark.parametrize("name", ["qwen05b", "gemma3", "smollm2-Q8_0"])
def test_real_templates_without_thinking_leave_the_reply_whole(name: str) -> None:
    """The real files here write no reasoning form (no channels, no <think> in their templates, and
    Qwen2.5-Coder's vocabulary splits "<think>" into 3 tokens): their replies stay whole."""
    from infer.chat import ChatTemplate
    from infer.gguf_file import GGUFModel
    from tests.oracle.fixtures import model_path

    model = GGUFModel(model_path(name))
    tokenizer = Tokenizer.from_gguf(model.metadata)
    assert reasoning_format(ChatTemplate.from_gguf(model.metadata, tokenizer).source, tokenizer) is None
