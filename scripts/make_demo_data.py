"""Generate the small bundled demo instruction-tuning dataset (alpaca format).

The dataset is written from scratch for memtune: a few hundred short, templated,
mixed Chinese/English examples drawn from a handful of task families (capitals,
antonyms, colour and number translation, next weekday, addition, uppercasing,
repetition, plurals, animal classes, greetings). Answers are short and fully
determined by the prompt, so even a tiny randomly initialised transformer can
visibly reduce its loss on them within a few dozen optimizer steps.

Generation is deterministic (``random.Random(0)``), so re-running reproduces a
byte-identical file.

Usage:
    python3 scripts/make_demo_data.py [OUTPUT_PATH]

OUTPUT_PATH defaults to ``src/memtune/assets/demo_alpaca.jsonl`` under the repo root.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "src" / "memtune" / "assets" / "demo_alpaca.jsonl"

Example = dict[str, str]

# (English name, English capital, Chinese name, Chinese capital)
CAPITALS: list[tuple[str, str, str, str]] = [
    ("France", "Paris", "法国", "巴黎"),
    ("Germany", "Berlin", "德国", "柏林"),
    ("Japan", "Tokyo", "日本", "东京"),
    ("China", "Beijing", "中国", "北京"),
    ("Italy", "Rome", "意大利", "罗马"),
    ("Spain", "Madrid", "西班牙", "马德里"),
    ("the United Kingdom", "London", "英国", "伦敦"),
    ("Russia", "Moscow", "俄罗斯", "莫斯科"),
    ("Egypt", "Cairo", "埃及", "开罗"),
    ("Canada", "Ottawa", "加拿大", "渥太华"),
    ("Australia", "Canberra", "澳大利亚", "堪培拉"),
    ("India", "New Delhi", "印度", "新德里"),
    ("South Korea", "Seoul", "韩国", "首尔"),
    ("Greece", "Athens", "希腊", "雅典"),
    ("Thailand", "Bangkok", "泰国", "曼谷"),
]

ANTONYMS_EN: list[tuple[str, str]] = [
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("fast", "slow"),
    ("happy", "sad"),
    ("day", "night"),
    ("black", "white"),
    ("left", "right"),
    ("early", "late"),
    ("full", "empty"),
    ("wet", "dry"),
    ("rich", "poor"),
    ("win", "lose"),
    ("inside", "outside"),
]

ANTONYMS_ZH: list[tuple[str, str]] = [
    ("大", "小"),
    ("上", "下"),
    ("多", "少"),
    ("长", "短"),
    ("快", "慢"),
    ("冷", "热"),
    ("黑", "白"),
    ("左", "右"),
    ("前", "后"),
    ("早", "晚"),
    ("远", "近"),
    ("轻", "重"),
    ("哭", "笑"),
    ("真", "假"),
]

COLOURS: list[tuple[str, str]] = [
    ("red", "红色"),
    ("blue", "蓝色"),
    ("green", "绿色"),
    ("yellow", "黄色"),
    ("black", "黑色"),
    ("white", "白色"),
    ("purple", "紫色"),
    ("orange", "橙色"),
    ("pink", "粉色"),
    ("brown", "棕色"),
    ("grey", "灰色"),
]

NUMBERS: list[tuple[str, str]] = [
    ("one", "一"),
    ("two", "二"),
    ("three", "三"),
    ("four", "四"),
    ("five", "五"),
    ("six", "六"),
    ("seven", "七"),
    ("eight", "八"),
    ("nine", "九"),
    ("ten", "十"),
]

WEEKDAYS_EN: list[str] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
]
WEEKDAYS_ZH: list[str] = ["星期一", "星期二", "星期三", "星期四", "星期五", "星期六", "星期日"]

WORDS_EN: list[str] = [
    "apple",
    "river",
    "music",
    "green",
    "table",
    "house",
    "light",
    "water",
    "happy",
    "cloud",
    "train",
    "bread",
]
WORDS_ZH: list[str] = [
    "苹果",
    "河流",
    "音乐",
    "桌子",
    "房子",
    "月亮",
    "太阳",
    "火车",
    "面包",
    "老师",
]

PLURALS: list[tuple[str, str]] = [
    ("cat", "cats"),
    ("dog", "dogs"),
    ("book", "books"),
    ("box", "boxes"),
    ("bus", "buses"),
    ("city", "cities"),
    ("baby", "babies"),
    ("leaf", "leaves"),
    ("knife", "knives"),
    ("child", "children"),
    ("mouse", "mice"),
    ("foot", "feet"),
    ("tooth", "teeth"),
    ("man", "men"),
    ("woman", "women"),
    ("goose", "geese"),
    ("sheep", "sheep"),
    ("key", "keys"),
]

# (English name, Chinese name, class index: 0 mammal, 1 bird, 2 fish)
ANIMALS: list[tuple[str, str, int]] = [
    ("dog", "狗", 0),
    ("cat", "猫", 0),
    ("horse", "马", 0),
    ("cow", "牛", 0),
    ("whale", "鲸鱼", 0),
    ("dolphin", "海豚", 0),
    ("lion", "狮子", 0),
    ("elephant", "大象", 0),
    ("bat", "蝙蝠", 0),
    ("tiger", "老虎", 0),
    ("eagle", "老鹰", 1),
    ("sparrow", "麻雀", 1),
    ("penguin", "企鹅", 1),
    ("owl", "猫头鹰", 1),
    ("parrot", "鹦鹉", 1),
    ("duck", "鸭子", 1),
    ("pigeon", "鸽子", 1),
    ("salmon", "三文鱼", 2),
    ("shark", "鲨鱼", 2),
    ("tuna", "金枪鱼", 2),
    ("goldfish", "金鱼", 2),
    ("trout", "鳟鱼", 2),
    ("carp", "鲤鱼", 2),
]
CLASSES_EN: list[str] = ["mammal", "bird", "fish"]
CLASSES_ZH: list[str] = ["哺乳动物", "鸟类", "鱼类"]

NAMES_EN: list[str] = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Frank",
    "Grace",
    "Henry",
    "Lily",
    "Tom",
]
NAMES_ZH: list[str] = [
    "小明",
    "小红",
    "小刚",
    "小丽",
    "李雷",
    "张伟",
    "王芳",
    "刘洋",
    "陈静",
    "赵敏",
]


def ex(instruction: str, output: str, inp: str = "") -> Example:
    """Build one alpaca-format example with keys in a fixed order."""
    return {"instruction": instruction, "input": inp, "output": output}


def pick(rng: random.Random, candidates: list[Example], n: int) -> list[Example]:
    """Deterministically sample ``n`` distinct candidates."""
    if n > len(candidates):
        raise ValueError(f"asked for {n} examples but only {len(candidates)} candidates")
    return rng.sample(candidates, n)


def capitals(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for country, city, guo, shou in CAPITALS:
        en.append(ex(f"What is the capital of {country}?", city))
        en.append(ex(f"Which city is the capital of {country}?", city))
        en.append(ex("Name the capital city of the given country.", city, country))
        zh.append(ex(f"{guo}的首都是哪里？", shou))
        zh.append(ex(f"请说出{guo}的首都。", shou))
        zh.append(ex("下面这个国家的首都是哪座城市？", shou, guo))
    return pick(rng, en, 18) + pick(rng, zh, 18)


def antonyms(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for a, b in ANTONYMS_EN:
        for word, opp in ((a, b), (b, a)):
            en.append(ex(f'What is the opposite of "{word}"?', opp))
            en.append(ex("Give the antonym of the word.", opp, word))
    for a, b in ANTONYMS_ZH:
        for word, opp in ((a, b), (b, a)):
            zh.append(ex(f"“{word}”的反义词是什么？", opp))
            zh.append(ex("请写出这个字的反义词。", opp, word))
    return pick(rng, en, 16) + pick(rng, zh, 16)


def colours(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for word, hanzi in COLOURS:
        en.append(ex("Translate the colour into Chinese.", hanzi, word))
        en.append(ex(f'How do you say the colour "{word}" in Chinese?', hanzi))
        zh.append(ex("把这个颜色词翻译成中文。", hanzi, word))
        zh.append(ex(f"英文颜色词“{word}”用中文怎么说？", hanzi))
    return pick(rng, en, 12) + pick(rng, zh, 12)


def numbers(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for word, hanzi in NUMBERS:
        en.append(ex("Translate the number word into Chinese.", hanzi, word))
        en.append(ex(f'Write the number "{word}" as a Chinese character.', hanzi))
        zh.append(ex("把这个英文数字翻译成中文。", hanzi, word))
        zh.append(ex(f"英文数字“{word}”的中文是什么？", hanzi))
    return pick(rng, en, 10) + pick(rng, zh, 10)


def weekdays(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for i, day in enumerate(WEEKDAYS_EN):
        nxt = WEEKDAYS_EN[(i + 1) % 7]
        en.append(ex(f"What day comes after {day}?", nxt))
        en.append(ex(f"Which day of the week follows {day}?", nxt))
        en.append(ex("Name the day that comes after the given day.", nxt, day))
    for i, day in enumerate(WEEKDAYS_ZH):
        nxt = WEEKDAYS_ZH[(i + 1) % 7]
        zh.append(ex(f"{day}的后一天是星期几？", nxt))
        zh.append(ex(f"{day}之后是哪一天？", nxt))
        zh.append(ex("请说出下面这一天的后一天。", nxt, day))
    return pick(rng, en, 14) + pick(rng, zh, 14)


def addition(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for a in range(1, 10):
        for b in range(1, 10):
            s = str(a + b)
            en.append(ex(f"What is {a} + {b}?", s))
            en.append(ex(f"Add {a} and {b}.", s))
            en.append(ex("Compute the sum.", s, f"{a} + {b}"))
            zh.append(ex(f"{a}加{b}等于几？", f"答案是{s}"))
            zh.append(ex(f"计算{a}+{b}。", f"答案是{s}"))
            zh.append(ex("请计算下面的算式。", f"答案是{s}", f"{a} + {b}"))
    return pick(rng, en, 20) + pick(rng, zh, 20)


def uppercase(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for word in WORDS_EN:
        en.append(ex("Convert the word to uppercase.", word.upper(), word))
        en.append(ex(f'Write "{word}" in capital letters.', word.upper()))
        zh.append(ex("把这个英文单词改成大写。", word.upper(), word))
        zh.append(ex(f"请把“{word}”全部写成大写字母。", word.upper()))
    return pick(rng, en, 12) + pick(rng, zh, 8)


def repeat(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for word in WORDS_EN:
        en.append(ex("Repeat the word twice.", f"{word} {word}", word))
        en.append(ex(f'Say "{word}" two times.', f"{word} {word}"))
    for word in WORDS_ZH:
        zh.append(ex("把下面的词重复两遍。", f"{word} {word}", word))
        zh.append(ex(f"请把“{word}”说两遍。", f"{word} {word}"))
    return pick(rng, en, 10) + pick(rng, zh, 14)


def plurals(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for word, plural in PLURALS:
        en.append(ex(f'What is the plural of "{word}"?', plural))
        en.append(ex("Give the plural form of the noun.", plural, word))
        zh.append(ex(f"英文单词“{word}”的复数形式是什么？", plural))
        zh.append(ex("写出这个英文名词的复数形式。", plural, word))
    return pick(rng, en, 14) + pick(rng, zh, 10)


def animals(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for name, hanzi, cls in ANIMALS:
        article = "an" if name[0] in "aeiou" else "a"
        en.append(ex(f"Is {article} {name} a mammal, a bird, or a fish?", CLASSES_EN[cls]))
        en.append(ex("Classify the animal as mammal, bird, or fish.", CLASSES_EN[cls], name))
        zh.append(ex(f"{hanzi}是哺乳动物、鸟类还是鱼类？", CLASSES_ZH[cls]))
        zh.append(ex("判断这种动物属于哺乳动物、鸟类还是鱼类。", CLASSES_ZH[cls], hanzi))
    return pick(rng, en, 20) + pick(rng, zh, 20)


def greetings(rng: random.Random) -> list[Example]:
    en: list[Example] = []
    zh: list[Example] = []
    for name in NAMES_EN:
        en.append(ex(f"Say hello to {name}.", f"Hello, {name}!"))
        en.append(ex(f"Greet {name}.", f"Hello, {name}!"))
        en.append(ex("Write a greeting for this person.", f"Hello, {name}!", name))
    for name in NAMES_ZH:
        zh.append(ex(f"向{name}问好。", f"你好，{name}！"))
        zh.append(ex(f"跟{name}打个招呼。", f"你好，{name}！"))
        zh.append(ex("请向下面这个人打招呼。", f"你好，{name}！", name))
    return pick(rng, en, 16) + pick(rng, zh, 16)


FAMILIES = [
    capitals,
    antonyms,
    colours,
    numbers,
    weekdays,
    addition,
    uppercase,
    repeat,
    plurals,
    animals,
    greetings,
]


def build(seed: int = 0) -> list[Example]:
    """Build the full shuffled dataset."""
    rng = random.Random(seed)
    data: list[Example] = []
    for family in FAMILIES:
        data.extend(family(rng))
    keys = [(d["instruction"], d["input"]) for d in data]
    if len(set(keys)) != len(keys):
        raise RuntimeError("duplicate prompts in generated data")
    rng.shuffle(data)
    return data


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUTPUT
    data = build()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8", newline="\n") as f:
        for row in data:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(data)} examples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
