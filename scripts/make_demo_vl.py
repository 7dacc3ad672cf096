"""Draw the small bundled image demo set (issue #49 item 7): shapes, digits and counts in
colours, with captions and questions, nothing downloaded.

Writes ``src/memtune/assets/demo_vl/``: ``images/*.png`` (small flat drawings, a few hundred
bytes each) and ``train.jsonl``, conversations whose image paths are relative to it. Most are in
the Qwen / Hugging Face message shape (a ``content`` list of ``{"type": "image"}`` and
``{"type": "text"}`` parts); some in the ShareGPT shape (``<image>`` in the text, an ``images``
list beside the turns); a few hold two images, a few are multi-turn. What a tiny random model
learns from it in a minute is mostly the answers' wording: the set shows the pipeline working
end to end on CPU ranks, with answers that a longer run can tie to the pictures.

The files are committed (the demo runs from a fresh clone with no step of its own); this script
is how they were made. Deterministic: drawings have no randomness and the records are in a fixed
order, so re-running with the same Pillow gives the same files.

Usage:
    python3 scripts/make_demo_vl.py [OUTPUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "src" / "memtune" / "assets" / "demo_vl"

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 210),
    "yellow": (235, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("zero", "one", "two", "three", "four")
BACKGROUND = (250, 250, 250)


def shape_image(shape: str, colour: tuple[int, int, int]) -> Image.Image:
    """One shape filling most of a 64 × 64 picture."""
    image = Image.new("RGB", (64, 64), BACKGROUND)
    draw = ImageDraw.Draw(image)
    box = (10, 10, 54, 54)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(32, 8), (56, 54), (8, 54)], fill=colour)
    return image


def digit_image(digit: int, colour: tuple[int, int, int]) -> Image.Image:
    """A digit in Pillow's own font, on a 64 wide, 96 high picture (6 image tokens where a
    64 × 64 one has 4: the set has two sizes)."""
    image = Image.new("RGB", (64, 96), BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=64)
    draw.text((32, 48), str(digit), fill=colour, font=font, anchor="mm")
    return image


def count_image(n: int, colour: tuple[int, int, int]) -> Image.Image:
    """``n`` small squares in a row on a 96 wide, 64 high picture."""
    image = Image.new("RGB", (96, 64), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for i in range(n):
        x = 8 + i * 22
        draw.rectangle((x, 22, x + 16, 38), fill=colour)
    return image


def parts(*items: str) -> list[dict[str, str]]:
    """A user turn's content: ``images/…`` names become image parts, the rest text parts."""
    return [
        {"type": "image", "image": s} if s.startswith("images/") else {"type": "text", "text": s}
        for s in items
    ]


def chat(*turns: tuple[list[dict[str, str]], str]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for content, answer in turns:
        messages += [
            {"role": "user", "content": content},
            {"role": "assistant", "content": answer},
        ]
    return {"messages": messages}


def sharegpt(image: str, question: str, answer: str) -> dict[str, Any]:
    return {
        "conversations": [
            {"from": "human", "value": f"<image>{question}"},
            {"from": "gpt", "value": answer},
        ],
        "images": [image],
    }


def build(out: Path) -> list[dict[str, Any]]:
    (out / "images").mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    names = list(COLOURS)

    def save(image: Image.Image, name: str) -> str:
        image.save(out / "images" / name, optimize=True)
        return f"images/{name}"

    shapes = {}
    for shape in SHAPES:
        for colour, rgb in COLOURS.items():
            shapes[shape, colour] = save(shape_image(shape, rgb), f"{colour}-{shape}.png")
    for k, ((shape, colour), img) in enumerate(shapes.items()):
        records.append(chat((parts(img, "Describe the picture."), f"A {colour} {shape}.")))
        records.append(chat((parts("What colour is the shape?", img), f"{colour.title()}.")))
        if k % 3 == 0:  # a third as ShareGPT records
            records.append(sharegpt(img, "What shape is this?", f"A {shape}."))
        else:
            records.append(chat((parts(img, "What shape is this?"), f"A {shape}.")))
        if k % 4 == 1:  # multi-turn: a second question about the same picture
            records.append(
                chat(
                    (parts(img, "What shape is this?"), f"A {shape}."),
                    (parts("And its colour?"), f"{colour.title()}."),
                )
            )

    for digit in range(10):
        colour = names[digit % len(names)]
        img = save(digit_image(digit, COLOURS[colour]), f"digit-{digit}.png")
        records.append(chat((parts(img, "What digit is this?"), f"{digit}.")))
        if digit % 2:
            records.append(sharegpt(img, "Read the number.", f"It says {digit}."))
        else:
            records.append(chat((parts(img, "Read the number."), f"It says {digit}.")))

    for n in range(1, 5):
        colour = names[(n + 1) % len(names)]
        img = save(count_image(n, COLOURS[colour]), f"count-{n}.png")
        plural = "square" if n == 1 else "squares"
        records.append(
            chat((parts("How many squares?", img), f"{NUMBERS[n].title()} {colour} {plural}."))
        )

    # Two pictures in one turn: the same colour or not.
    pairs = [("red", "circle", "red", "square"), ("blue", "triangle", "green", "triangle")]
    pairs += [("yellow", "square", "yellow", "circle"), ("green", "circle", "blue", "square")]
    for c1, s1, c2, s2 in pairs:
        same = "Yes, both are" if c1 == c2 else "No: one is"
        answer = f"{same} {c1}." if c1 == c2 else f"{same} {c1}, the other {c2}."
        records.append(
            chat((parts(shapes[s1, c1], shapes[s2, c2], "Are these the same colour?"), answer))
        )
    return records


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else DEFAULT_OUTPUT
    records = build(out)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    (out / "train.jsonl").write_text(text, encoding="utf-8")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{len(records)} conversations, {len(list(out.glob('images/*.png')))} images: {out}")
    print(f"{size / 1024:.1f} KiB in all")


if __name__ == "__main__":
    main(sys.argv[1:])
