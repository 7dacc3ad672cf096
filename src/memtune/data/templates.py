"""Prompt templates: how a conversation becomes text, and which parts of it are labels.

A rendered conversation is a list of segments ``(text, is_label)``. Consecutive prompt text
is one segment, so the tokens of a prompt in training are exactly the tokens generation
gets from :func:`render_prompt`. Only assistant replies are labels (unless
``train_on_prompt``), each followed by its end marker: ``<|im_end|>`` in ChatML, the
tokenizer's eos in the plain template. A model never trained on that marker never stops.

- ``chatml`` (Qwen2.5's format, no implicit default system prompt)::

      <|im_start|>system\\n{system}<|im_end|>\\n          (only when one is given)
      <|im_start|>user\\n{user}<|im_end|>\\n
      <|im_start|>assistant\\n{reply}<|im_end|>\\n        (label: "{reply}<|im_end|>")

- ``plain`` (the seeds' prompt)::

      {system}\\n\\n                                       (only when one is given)
      ### 指令:\\n{user}\\n\\n### 回答:\\n{reply}{eos}      (label: "{reply}{eos}")

  turns separated by a blank line.
"""

from __future__ import annotations

TEMPLATES = ("chatml", "plain")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

Segment = tuple[str, bool]


def with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The config's system prompt goes first unless the record brings its own."""
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def segments(messages: list[dict[str, str]], template: str, eos: str) -> list[Segment]:
    """Render a conversation ending in an assistant reply into labelled / unlabelled text."""
    out: list[Segment] = []

    def add(text: str, label: bool) -> None:
        if out and not label and not out[-1][1]:
            out[-1] = (out[-1][0] + text, False)
        elif text:
            out.append((text, label))

    last = len(messages) - 1
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if template == "chatml":
            if role == "assistant":
                add(f"{IM_START}assistant\n", False)
                add(content + IM_END, True)
                add("\n", False)
            else:
                add(f"{IM_START}{role}\n{content}{IM_END}\n", False)
        elif template == "plain":
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


def render_prompt(messages: list[dict[str, str]], template: str, eos: str) -> str:
    """What a model is given to answer the conversation's next turn (generation): exactly
    the text that precedes a reply in training."""
    rendered = segments([*messages, {"role": "assistant", "content": ""}], template, eos)
    last_label = max(i for i, (_, label) in enumerate(rendered) if label)
    return "".join(text for text, _ in rendered[:last_label])
