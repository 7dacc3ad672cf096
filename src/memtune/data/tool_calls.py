"""Tool use in chat records: the functions a conversation offers (``tools``), the calls an
assistant reply makes, and the results that come back, read in the shapes datasets carry them
and rendered as Qwen's chat templates render them.

Read (by :mod:`memtune.data.readers`, format ``messages`` and ``preference``; ``alpaca``'s
``tools`` column too, as LLaMA-Factory has one):

- OpenAI's shape: a ``tools`` list beside the messages (function schemas, as a chat template is
  given them), an assistant turn's ``tool_calls`` (``[{"type": "function", "function":
  {"name": ..., "arguments": "<a JSON object>"}}]``, or the older one-call ``function_call``),
  its ``content`` null or text, and each result a ``{"role": "tool", "content": ...}`` turn.
- ShareGPT's (LLaMA-Factory's): ``tools`` a JSON string of that list, a call a
  ``{"from": "function_call", "value": "<JSON: a call or a list of calls>"}`` turn, a result an
  ``observation`` turn.

A bare function schema (LLaMA-Factory's ``{"name", "description", "parameters"}``) is
wrapped as ``{"type": "function", "function": {...}}``, as LLaMA-Factory wraps it for Qwen and
as an OpenAI-style server hands tools to the template. An empty ``tool_calls`` list is no call
(servers log one on every reply). A call is kept as ``{"name": str, "arguments": str |
dict}`` (a string as given: Qwen3's template writes it verbatim; it must hold a JSON object).
Consecutive results are one user turn, each wrapped in
``<tool_response>\\n…\\n</tool_response>`` as the templates render them (the raw results kept
beside, under ``tool_results``): turns then alternate user / assistant as in every other
conversation, a result is never a label (but with data.train_on_prompt, which labels every
prompt), and a call is one (the model writes it).

Rendered (by :mod:`memtune.data.templates`) as the templates render them, token for token
(tests/test_tool_calls.py, against Qwen3's and Qwen3.5's own templates):

- ``chatml`` and ``qwen3`` (Qwen2.5's and Qwen3's format): the system turn holds the system
  prompt, a blank line, then the tools, one JSON object a line, between Qwen's instructions;
  a call is ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`` after the
  reply's text and a newline, ARGS as JSON (qwen3: a string as given, as Qwen3's template
  writes it; chatml: the object a string holds, since Qwen2.5's template would write the string
  quoted, a JSON string inside the call). Qwen2.5's own template adds its default system
  prompt ("You are Qwen, created by Alibaba Cloud. ...") where tools come without one; chatml
  adds none, here as everywhere (data.system_prompt sets one).
- ``qwen3_5``: the tools and Qwen3.5's instructions first in the system turn, then the system
  prompt; a call is ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n…
  </function>\\n</tool_call>``, a value that is an object or a list written as JSON, any other as
  Python's ``str`` (jinja's ``string`` filter: ``True``, ``None``); a result stripped of
  surrounding whitespace.
- ``plain`` has no tool format: a record with tools or calls is a bad record there.
"""

from __future__ import annotations

import json
from typing import Any

Call = dict[str, Any]
"""``{"name": str, "arguments": str | dict}``."""

QWEN3_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN3_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
QWEN35_TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN35_TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)
TOOL_TEMPLATES = ("chatml", "qwen3", "qwen3_5")
"""The templates with a tool format (data.template)."""


class BadField(ValueError):
    """A tool field that cannot be read: the message names the field (the reader adds the
    record's file and line)."""


def _json(x: Any) -> str:
    """As the chat templates' ``tojson`` writes it (transformers' filter: no HTML escaping, keys
    in their order, ``", "`` and ``": "`` between items)."""
    return json.dumps(x, ensure_ascii=False)


def parse_tools(value: Any, at: str = "tools") -> list[dict[str, Any]] | None:
    """A record's ``tools``: a list of objects, or a JSON string of one (LLaMA-Factory's);
    None where absent or empty (the templates then write no tools)."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise BadField(f"field {at!r} is a string but not JSON ({err.msg})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadField(f"field {at!r} must be a list of objects (function schemas)")
    return [_wrapped(tool) for tool in value] or None


def _wrapped(tool: dict[str, Any]) -> dict[str, Any]:
    """A function schema as an OpenAI-style server hands it to the chat template,
    ``{"type": "function", "function": {...}}``: a bare ``{"name", "description",
    "parameters"}`` (LLaMA-Factory's datasets; the Responses API's flat one, ``type`` beside
    them) is wrapped, as LLaMA-Factory wraps it for Qwen, so that training writes the tools as
    the served model is prompted with them. Anything else is kept as given."""
    if "function" in tool or "name" not in tool:
        return tool
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def parse_call(value: Any, at: str) -> Call:
    """One call: OpenAI's ``{"type": "function", "function": {"name", "arguments"}}`` or the
    bare ``{"name", "arguments"}``. ``arguments``: an object, or a string holding one."""
    if not isinstance(value, dict):
        raise BadField(f"field {at!r} is not an object")
    if "function" in value:
        value, at = value["function"], f"{at}.function"
        if not isinstance(value, dict):
            raise BadField(f"field {at!r} is not an object")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadField(f"field '{at}.name' is missing or not a non-empty string")
    if "arguments" not in value:
        raise BadField(f"field '{at}.arguments' is missing (a call without arguments has {{}})")
    args = value["arguments"]
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError as err:
            raise BadField(f"field '{at}.arguments' is a string but not JSON ({err.msg})") from None
        if not isinstance(parsed, dict):
            raise BadField(f"field '{at}.arguments' holds JSON that is not an object")
    elif not isinstance(args, dict):
        what = type(args).__name__
        raise BadField(f"field '{at}.arguments' is a {what}, not an object or a JSON string")
    return {"name": name, "arguments": args}


def parse_calls(value: Any, at: str) -> list[Call]:
    """An assistant turn's ``tool_calls``: a non-empty list of calls."""
    if not isinstance(value, list) or not value:
        raise BadField(f"field {at!r} must be a non-empty list of calls")
    return [parse_call(call, f"{at}[{i}]") for i, call in enumerate(value)]


def sharegpt_calls(text: Any, at: str) -> list[Call]:
    """A ShareGPT ``function_call`` turn's value: JSON of one call or of a list of calls."""
    if not isinstance(text, str):
        raise BadField(f"field {at!r} is missing or not a string")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadField(
            f"field {at!r} is not JSON ({err.msg}): a function_call turn holds a call "
            '{"name": ..., "arguments": {...}} or a list of them'
        ) from None
    if isinstance(value, list):
        return parse_calls(value, at)
    return [parse_call(value, at)]


def wrap_results(results: list[str]) -> str:
    """The user turn the templates make of consecutive tool results."""
    return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


def system_text(tools: list[dict[str, Any]], system: str | None, template: str) -> str:
    """What the system turn holds (between ``<|im_start|>system\\n`` and ``<|im_end|>``) when a
    conversation offers ``tools``; ``system``: its system message's content (None: it has
    none)."""
    listed = "".join("\n" + _json(tool) for tool in tools)
    if template == "qwen3_5":
        own = (system or "").strip()
        return QWEN35_TOOLS_HEAD + listed + QWEN35_TOOLS_TAIL + (f"\n\n{own}" if own else "")
    prefix = "" if system is None else system + "\n\n"
    return prefix + QWEN3_TOOLS_HEAD + listed + QWEN3_TOOLS_TAIL


def _arguments(call: Call) -> dict[str, Any]:
    args = call["arguments"]
    return json.loads(args) if isinstance(args, str) else args


def calls_text(calls: list[Call], content: str, template: str) -> str:
    """What follows a reply's text ``content`` (its reasoning taken apart) for its calls."""
    if template == "qwen3_5":
        out = []
        for i, call in enumerate(calls):
            lead = "\n" if i else ("\n\n" if content.strip() else "")
            params = []
            for key, value in _arguments(call).items():
                shown = _json(value) if isinstance(value, dict | list) else str(value)
                params.append(f"<parameter={key}>\n{shown}\n</parameter>\n")
            name = call["name"]
            out.append(f"{lead}<tool_call>\n<function={name}>\n{''.join(params)}</function>\n")
            out.append("</tool_call>")
        return "".join(out)
    out = []
    for i, call in enumerate(calls):
        args = call["arguments"]
        # Qwen3 writes a string as given; Qwen2.5 (chatml) writes every value through tojson,
        # a string as a quoted string, so the object it holds is what a Qwen2.5 call is
        shown = args if isinstance(args, str) and template == "qwen3" else _json(_arguments(call))
        lead = "\n" if (i or content) else ""
        name = call["name"]
        out.append(f'{lead}<tool_call>\n{{"name": "{name}", "arguments": {shown}}}\n</tool_call>')
    return "".join(out)


def same_reply(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two replies are the same, their calls' arguments compared as the objects they
    hold (a string and the object it holds, or two spacings of one object, are one call)."""

    def canonical(m: dict[str, Any]) -> dict[str, Any]:
        if "tool_calls" not in m:
            return m
        calls = [{**c, "arguments": _arguments(c)} for c in m["tool_calls"]]
        return {**m, "tool_calls": calls}

    return canonical(a) == canonical(b)


def has_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether a conversation offers tools, calls one, or holds a result."""
    return bool(tools) or any("tool_calls" in m or "tool_results" in m for m in messages)
