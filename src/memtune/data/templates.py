"""Prompt templates: how a conversation becomes text, and which parts of it are labels.

A rendered conversation is a list of segments ``(text, is_label)``, each tokenized on its own.
Consecutive prompt text is one segment, so a reply's first label follows exactly the tokens
generation gets from :func:`render_prompt` (unless an earlier reply starts with a newline,
below), and its ids are those a model writes after that prompt, never one merged with the
prompt's last token. That is the whole text tokenized at once except where a reply starts with
a newline right after its prompt's (ChatML, plain, qwen3 replies without a think block): Qwen's
BPE would join the two into one token. An earlier reply of a multi-turn conversation that
starts so then has other ids than the conversation tokenized whole (docs/data.md, "Tokenized
segment by segment").

Tool use (the functions offered, calls, results) is rendered as :mod:`memtune.data.tool_calls`
says, in every template but ``plain``.

Only assistant replies are labels (unless ``train_on_prompt``), each followed by its end
marker: ``<|im_end|>`` in ChatML, the tokenizer's eos in the plain template. A model never
trained on that marker never stops.

- ``chatml`` (Qwen2.5's format, no implicit default system prompt)::

      <|im_start|>system\\n{system}<|im_end|>\\n          (only when one is given)
      <|im_start|>user\\n{user}<|im_end|>\\n
      <|im_start|>assistant\\n{reply}<|im_end|>\\n        (label: "{reply}<|im_end|>")

- ``plain`` (the seeds' prompt)::

      {system}\\n\\n                                       (only when one is given)
      ### 指令:\\n{user}\\n\\n### 回答:\\n{reply}{eos}      (label: "{reply}{eos}")

  turns separated by a blank line.

- ``qwen3`` (Qwen3's chat template, as its tokenizer renders a conversation): ChatML, and the
  final reply opens with a think block. (Its template finds the last query — the last user turn
  that is not a tool result wrapped whole in ``<tool_response>…</tool_response>`` — and an
  earlier reply after that query, a tool call, gets a block too when it has reasoning.)
  Without reasoning (thinking off) the block is empty and belongs to the prompt — it is what
  Qwen3's template appends to the generation prompt with ``enable_thinking=False``::

      <|im_start|>assistant\n<think>\n\n</think>\n\n{reply}<|im_end|>\n
                                                          (label: "{reply}<|im_end|>")

  With reasoning — a ``reasoning_content`` field, or a ``<think>…</think>`` prefix of the
  reply — the model writes the block itself, so it is learned::

      <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{reply}<|im_end|>\n
                                               (label: "<think>\n{reasoning}…{reply}<|im_end|>")

  Earlier replies (other than a tool call's with reasoning after the last query) are rendered
  as Qwen3 renders history: the reply alone, reasoning dropped.

- ``qwen3_5`` (Qwen3.5's chat template, text only): ChatML with every message's content
  stripped of surrounding whitespace, as that template strips it, and a think block on every
  reply after the last user query, even an empty one. Labels follow one rule, the one that
  gives qwen3's: the prompt of the reply being learned ends where the template's generation
  prompt ends, so a reply's tokens in training come after exactly the tokens generation gives
  the model. Without reasoning (thinking off, ``enable_thinking=False``) that is the whole
  empty block::

      <|im_start|>assistant\n<think>\n\n</think>\n\n{reply}<|im_end|>\n
                                                          (label: "{reply}<|im_end|>")

  With reasoning (thinking on: Qwen3.5's template opens the block in the generation prompt)
  the prompt ends after ``<think>\n`` and the model learns the rest of the block::

      <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{reply}<|im_end|>\n
                                     (label: "{reasoning}\n</think>\n\n{reply}<|im_end|>")

  Earlier replies: the reply alone, reasoning dropped, as in qwen3. (Qwen3.5's 0.8B and 2B
  templates differ from the others only in which generation prompt is the default; memtune
  always picks one explicitly.)
"""

from __future__ import annotations

from typing import Any

from memtune.data.tool_calls import calls_text, system_text, wrap_results

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"

Segment = tuple[str, bool]


def with_system(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """The config's system prompt goes first unless the record brings its own."""
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def segments(
    messages: list[dict[str, Any]],
    template: str,
    eos: str,
    tools: list[dict[str, Any]] | None = None,
) -> list[Segment]:
    """Render a conversation ending in an assistant reply into labelled / unlabelled text.
    ``tools``: the functions it offers; they, its calls and their results are rendered as
    :mod:`memtune.data.tool_calls` says (not in ``plain``, which has no tool format)."""
    out: list[Segment] = []

    def add(text: str, label: bool) -> None:
        if out and not label and not out[-1][1]:
            out[-1] = (out[-1][0] + text, False)
        elif text:
            out.append((text, label))

    last = len(messages) - 1
    # Without a query (every user turn a tool result) Qwen3's template takes the last message
    # for it, so no reply gets a think block; Qwen3.5's refuses such a conversation (memtune:
    # a bad record, data.cache).
    qwen3_last_query = max((i for i, m in enumerate(messages) if is_query(m, False)), default=last)
    qwen35_last_query = max((i for i, m in enumerate(messages) if is_query(m)), default=last)
    if tools and template == "plain":
        raise ValueError("data.template=plain has no tool format")
    if tools and messages[0]["role"] != "system":  # the tools alone make the system turn
        add(f"{IM_START}system\n{system_text(tools, None, template)}{IM_END}\n", False)
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "system" and tools:
            add(f"{IM_START}system\n{system_text(tools, content, template)}{IM_END}\n", False)
            continue
        calls = m.get("tool_calls")
        if template == "chatml":
            if role == "assistant":
                add(f"{IM_START}assistant\n", False)
                add(
                    content + (calls_text(calls, content, template) if calls else "") + IM_END, True
                )
                add("\n", False)
            else:
                add(f"{IM_START}{role}\n{content}{IM_END}\n", False)
        elif template == "qwen3":
            if role == "assistant":
                reasoning, reply = split_reasoning(m)
                tail = calls_text(calls, reply, template) if calls else ""
                add(f"{IM_START}assistant\n", False)
                # After the last query Qwen3 writes a think block on the final reply, and on an
                # earlier one (a tool call's) only when it has reasoning.
                if i > qwen3_last_query and (i == last or reasoning):
                    reply = reply.lstrip("\n")
                    block = f"{THINK}\n{reasoning.strip(chr(10))}\n{END_THINK}\n\n"
                    if reasoning:
                        reply = block + reply  # thinking on: the model writes the block
                    else:
                        add(block, False)  # thinking off: the prompt holds the empty block
                add(reply + tail + IM_END, True)
                add("\n", False)
            else:
                add(f"{IM_START}{role}\n{content}{IM_END}\n", False)
        elif template == "qwen3_5":
            content = content.strip()
            if "tool_results" in m:  # each result stripped, as Qwen3.5 strips a tool turn
                content = wrap_results([r.strip() for r in m["tool_results"]])
            if role == "assistant":
                reasoning, reply = split_reasoning({**m, "content": content})
                reasoning = reasoning.strip()
                tail = calls_text(calls, reply, template) if calls else ""
                add(f"{IM_START}assistant\n", False)
                if i > qwen35_last_query:
                    if reasoning:  # thinking on: the generation prompt opens the block
                        add(f"{THINK}\n", False)
                        reply = f"{reasoning}\n{END_THINK}\n\n{reply}"
                    else:  # thinking off: the prompt holds the empty block
                        add(f"{THINK}\n\n{END_THINK}\n\n", False)
                add(reply + tail + IM_END, True)
                add("\n", False)
            else:
                add(f"{IM_START}{role}\n{content}{IM_END}\n", False)
        elif template == "plain":
            if calls or "tool_results" in m:
                raise ValueError("data.template=plain has no tool format")
            if role == "system":
                add(f"{content}\n\n", False)
            elif role == "user":
                add(f"### 指令:\n{content}\n\n### 回答:\n", False)
            else:
                add(content + eos, True)
                if i != last:
                    add("\n\n", False)
        else:
            raise ValueError(f"unknown template {template!r}")
    return out


def is_query(message: dict[str, Any], strip: bool = True) -> bool:
    """A user turn that Qwen's templates count as a query: not a tool result, i.e. not
    wrapped whole in ``<tool_response>…</tool_response>``. Qwen3.5's template looks at the
    content stripped of surrounding whitespace; Qwen3's (``strip=False``) at it as it is."""
    content = message["content"].strip() if strip else message["content"]
    tool_result = content.startswith("<tool_response>") and content.endswith("</tool_response>")
    return message["role"] == "user" and not tool_result


def split_reasoning(message: dict[str, Any]) -> tuple[str, str]:
    """(reasoning, reply) of an assistant turn, as Qwen3's template takes them apart: the
    ``reasoning_content`` field, else the text before ``</think>`` (after ``<think>``)."""
    content = message["content"]
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"], content
    if END_THINK in content:
        head, _, _ = content.partition(END_THINK)
        reasoning = head.rstrip("\n").split(THINK)[-1].lstrip("\n")
        return reasoning, content.split(END_THINK)[-1].lstrip("\n")
    return "", content


def render_prompt(
    messages: list[dict[str, Any]],
    template: str,
    eos: str,
    thinking: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """What a model is given to answer the conversation's next turn (generation): exactly
    the text that precedes a reply in training. ``thinking`` (qwen3 and qwen3_5 only): leave
    the think block to the model, as Qwen's template does with ``enable_thinking=True``
    (Qwen3's prompt then ends before ``<think>``, Qwen3.5's after it)."""
    reply: dict[str, Any] = {"role": "assistant", "content": ""}
    if thinking and template in ("qwen3", "qwen3_5"):
        reply["reasoning_content"] = "…"  # any: the prompt then ends where its thinking starts
    rendered = segments([*messages, reply], template, eos, tools)
    last_label = max(i for i, (_, label) in enumerate(rendered) if label)
    return "".join(text for text, _ in rendered[:last_label])
