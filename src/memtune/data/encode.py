"""Records → token ids and labels (the template's label mask), and the length policy.

A preference pair is one :class:`Sample`: the chosen conversation's tokens, then the rejected
one's, ``split`` marking where the second starts. Each is tokenized exactly as SFT tokenizes
that conversation (so a pair's chosen sequence is the SFT sample of the same conversation,
token for token), but only the final reply is labelled: the objectives compare the two
replies' log-probabilities, and an earlier reply, the same in both, would add the same amount
to each side. The two share their prompt: where one reply has reasoning and the other none
(qwen3, qwen3_5), the think-block tokens in which they differ are labels of each side
(:func:`share_prompt`). The two halves stay together in one packed row, so data.max_seq_len
bounds the pair (:func:`apply_length_policy`).

A conversation with images (:attr:`Record.images`) is tokenized with one
``<|vision_start|><|image_pad|><|vision_end|>`` per image, as the Qwen VL chat templates write
it, and each ``<|image_pad|>`` is then repeated once per merged patch of its resized image, as
the model's processor repeats it (:mod:`memtune.data.vision`); the Sample keeps the resized
images and each token's ``mm_token_type_ids`` (1 on those repeated tokens). Image tokens are
always in the prompt (images are read in user turns only), so never labels.

Tokenization happens once, on the launcher side (:mod:`memtune.data.cache`); ranks read
the cache's flat arrays (:class:`memtune.data.batching.TokenizedDataset`) and only batch them.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from memtune.config import ConfigError, DataConfig, RunConfig
from memtune.data.readers import Record, RecordError
from memtune.data.templates import Segment, segments, with_system
from memtune.data.vision import (
    IMAGE_PAD,
    MM_IMAGE,
    MM_TEXT,
    VISION_TOKENS,
    ImageSettings,
    Resized,
    open_image,
)
from memtune.data.vision import resize as resize_image
from memtune.filesystem import human_bytes

if TYPE_CHECKING:
    import numpy as np

IGNORE_INDEX = -100


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]
    split: int = 0
    """A preference pair: the tokens are the chosen sequence, then the rejected one, and
    ``split`` is the chosen sequence's length (0: one sequence, SFT)."""
    index: int = -1
    """The item's index in its split of the cache (the key into the reference log-probs);
    -1: not read from a cache, or a label-free filler."""
    images: list[np.ndarray] = field(default_factory=list)
    """The resized images (``3 × H × W`` uint8), in the order of their tokens."""
    mm_token_type_ids: list[int] | None = None
    """Per token: 1 on an image's ``<|image_pad|>`` tokens, 0 elsewhere (None: no images)."""


@dataclass
class DataStats:
    records: int = 0
    skipped_bad: int = 0
    bad_examples: list[str] = field(default_factory=list)
    truncated: int = 0
    split: int = 0  # over-long documents cut into max_seq_len pieces (data.overlong=split)
    split_pieces: int = 0
    split_remnants: int = 0
    """Last pieces of a split document left without a label (one token: a target of nothing),
    dropped: not counted in ``split_pieces`` nor as samples without labels."""
    dropped_overlong: int = 0
    dropped_no_labels: int = 0
    """Samples without a label at their full length (not over-long)."""
    truncated_no_labels: int = 0
    """Over-long samples (pairs) dropped because the cut to data.max_seq_len left them no label:
    the prompt alone fills it. Counted apart from ``dropped_no_labels`` so that the line points
    at data.max_seq_len, the setting that lost them."""
    max_seq_len: int = 0
    """data.max_seq_len the counts were made with (0: not known, a cache built before it was
    recorded), named in the line."""
    samples: int = 0
    tokens: int = 0
    label_tokens: int = 0
    preference: bool = False
    """The data is preference pairs (format preference): each sample is a pair, and a pair
    that is truncated or dropped counts once."""
    identical_pairs: int = 0
    """Of skipped_bad: preference records whose chosen and rejected replies are the same."""
    images: int = 0
    """Images in the kept samples."""
    image_bytes: int = 0
    """Their resized pixels' bytes (uint8), what the cache holds for them."""
    dropped_image_cut: int = 0
    """Over-long samples dropped because data.max_seq_len falls inside an image's tokens (an
    image is never cut; a cut after it keeps it whole, one before it drops it)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def line(self) -> str:
        noun = "pairs" if self.preference else "samples"
        out = (
            f"{self.samples} {noun} from {self.records} records, {self.tokens:,} tokens "
            f"({self.label_tokens:,} labels); truncated {self.truncated}, dropped "
            f"{self.dropped_overlong} over-long + {self.dropped_no_labels} without labels"
        )
        if self.truncated_no_labels:
            out += (
                f" + {self.truncated_no_labels} truncated to {self._max_seq_len()} with no label "
                "left"
            )
        if self.split:
            out += f"; split {self.split} over-long documents into {self.split_pieces} pieces"
            if self.split_remnants:
                out += (
                    f" ({self.split_remnants} last pieces of one token, a target of nothing, "
                    "dropped)"
                )
        if self.images or self.dropped_image_cut:
            out += f"; {self.images:,} images ({human_bytes(self.image_bytes)} resized)"
            if self.dropped_image_cut:
                out += f", {self.dropped_image_cut} samples dropped: the cut fell in an image"
        if self.skipped_bad:
            identical = (
                f"{self.identical_pairs} with identical replies; " if self.identical_pairs else ""
            )
            records = "record" if self.skipped_bad == 1 else "records"
            out += (
                f"; skipped {self.skipped_bad} bad {records} ({identical}first: "
                f"{self.bad_examples[0]})"
            )
        return out

    def _max_seq_len(self) -> str:
        return f"data.max_seq_len={self.max_seq_len}" if self.max_seq_len else "data.max_seq_len"

    def length_hint(self) -> str:
        """When samples were lost to data.max_seq_len, what that was and what to change (for
        the refusal of a split left empty); "" when none were."""
        noun = "pairs" if self.preference else "samples"
        held = ", held in both sequences," if self.preference else ""
        parts = [
            (self.truncated_no_labels, f"with the prompt{held} alone filling it"),
            (self.dropped_overlong, "dropped by data.overlong=drop"),
            (self.dropped_image_cut, "with the cut inside an image"),
        ]
        lost = sum(n for n, _ in parts)
        if not lost:
            return ""
        why = "; ".join(f"{n} {what}" for n, what in parts if n)
        return (
            f": {lost} {noun} are longer than {self._max_seq_len()} ({why}); raise data.max_seq_len"
        )


def load_tokenizer(cfg: RunConfig) -> Any:
    """The model's tokenizer (transformers' AutoTokenizer): the launcher tokenizes with it once,
    the ranks decode and check it."""
    m = cfg.model
    check_downloadable(m.name_or_path, m.revision)
    from transformers import AutoTokenizer

    pinned = {"revision": m.revision} if m.revision else {}
    tok = AutoTokenizer.from_pretrained(
        m.name_or_path, trust_remote_code=m.trust_remote_code, **pinned
    )
    if tok.pad_token_id is None:
        raise ConfigError(f"{cfg.model.name_or_path}: the tokenizer has no pad token")
    return tok


HUB_CONNECT_TIMEOUT_S = 3.0
"""How long the check before a download waits for the hub to answer a TCP connect."""
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable


def offline_by(*names: str) -> str | None:
    """The first of these variables set true (huggingface_hub's reading), or None."""
    return next((v for v in names if os.environ.get(v, "").upper() in _TRUE), None)


def check_downloadable(name_or_path: str, revision: str | None = None) -> None:
    """A hub name that is not on disk must be downloadable: refuse at once when it cannot be.

    Without this, a machine without the hub (or with HF_HUB_OFFLINE set) spends ~50 s in
    huggingface_hub's retries, printed twice (Hydra's log repeats them), and ends in a
    traceback from inside transformers. Asked before any download: the name is neither a local
    path nor in the local Hugging Face cache, and HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is
    set, or the hub's host does not accept a TCP connection within HUB_CONNECT_TIMEOUT_S. With
    a proxy configured the connection is the proxy's to make, so nothing is probed then.
    ``revision``: model.revision (None: main)."""
    if Path(name_or_path).expanduser().exists() or _in_hub_cache(name_or_path, revision):
        return
    offline = offline_by("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    if offline is not None:
        reason = f"{offline} is set, so nothing is downloaded"
    else:
        problem = hub_unreachable()
        if problem is None:
            return
        reason = problem
    from huggingface_hub.constants import HF_HUB_CACHE

    at = f" (model.revision={revision})" if revision else ""
    raise ConfigError(
        f"model.name_or_path={name_or_path!r}{at} is not on disk (no such directory, not in the "
        f"Hugging Face cache {HF_HUB_CACHE}) and {reason}: train a checkpoint on disk with "
        "model=local model.name_or_path=/path/to/checkpoint, or download it first "
        f"(hf download {name_or_path}, where the hub is reachable); once it is in the cache, "
        "HF_HUB_OFFLINE=1 loads it from there without asking the hub"
    )


def _in_hub_cache(name: str, revision: str | None = None) -> bool:
    """The model's config or tokenizer config, at ``revision``, is in the local Hugging Face
    cache."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "tokenizer_config.json"):
        try:
            if isinstance(try_to_load_from_cache(name, filename, revision=revision), str):
                return True
        except Exception:  # not a valid repo id (HFValidationError): in no cache
            return False
    return False


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached from this machine, or None when it answers (or a proxy
    stands between, which only the download itself can judge). The connect runs in a thread
    so a stalled name lookup (not covered by a socket timeout) cannot hold the launch."""
    from huggingface_hub.constants import ENDPOINT

    url = urlsplit(ENDPOINT)
    proxies = ["HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]
    if url.scheme == "http":
        proxies += ["HTTP_PROXY", "http_proxy"]
    if any(os.environ.get(v) for v in proxies) or not url.hostname:
        return None
    address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=HUB_CONNECT_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(err)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(HUB_CONNECT_TIMEOUT_S + 0.5)
    if not outcome:
        return f"{ENDPOINT} did not answer within {HUB_CONNECT_TIMEOUT_S:g} s"
    if outcome[0] is None:
        return None
    return f"{ENDPOINT} cannot be reached from this machine ({outcome[0]})"


def resize_record_images(rec: Record, settings: ImageSettings) -> list[Resized]:
    """A record's images read whole and resized (:func:`memtune.data.vision.resize`); a
    missing, unreadable, truncated or undecodable image raises RecordError naming the record
    and the image."""
    processor = settings.processor()
    out = []
    for ref in rec.images:
        try:
            pixels = resize_image(open_image(ref), settings, processor)
        except (OSError, ValueError, SyntaxError) as err:  # what PIL raises for bad files
            raise RecordError(rec.where, f"{ref.label}: cannot read the image ({err})") from err
        out.append(Resized(pixels, settings.tokens(*pixels.shape[1:])))
    return out


def encode_records(
    records: Sequence[Record],
    tokenizer: Any,
    cfg: DataConfig,
    images: Sequence[Sequence[Resized]] | None = None,
) -> list[Sample]:
    """Tokenize rendered segments in one batch call (the fast tokenizer runs it in parallel).
    A preference record (``Record.pair``) gives one Sample holding both its sequences (see the
    module docstring); data.train_on_prompt does not apply to it. ``images``: each record's
    resized images (:func:`resize_record_images`), for the records that have any."""
    if images is None and any(rec.images for rec in records):
        raise ConfigError(
            f"{next(r.where for r in records if r.images)}: the record has images, and the "
            "model has no image processor settings (preprocessor_config.json, or "
            "processor_config.json's image_processor, next to its config.json): train images "
            "with a vision-language model (Qwen3.5, Qwen3-VL, Qwen2.5-VL)"
        )
    eos = tokenizer.eos_token
    rendered: list[tuple[list[Segment], bool]] = []  # (segments, label the prompt too)
    for rec in records:
        if rec.text is not None:
            rendered.append(([(rec.text + eos, True)], True))
        elif rec.pair is not None:
            for messages in rec.conversations():
                msgs = with_system(messages, cfg.system_prompt)
                rendered.append(
                    (final_reply_only(segments(msgs, cfg.template, eos, rec.tools)), False)
                )
        else:
            assert rec.messages is not None
            msgs = with_system(rec.messages, cfg.system_prompt)
            rendered.append((segments(msgs, cfg.template, eos, rec.tools), cfg.train_on_prompt))
    flat = [text for segs, _ in rendered for text, _ in segs]
    with_images = images is not None and any(rec.images for rec in records)
    if with_images:
        flat.append(IMAGE_PAD)
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    image_pad = image_pad_id(ids.pop(), tokenizer) if with_images else -1
    sequences, k = [], 0
    for segs, label_all in rendered:
        input_ids: list[int] = []
        labels: list[int] = []
        for _, is_label in segs:
            piece = ids[k]
            k += 1
            input_ids += piece
            labels += piece if (is_label or label_all) else [IGNORE_INDEX] * len(piece)
        sequences.append(Sample(input_ids, labels))
    samples, next_sequence = [], iter(sequences)
    for i, rec in enumerate(records):
        if rec.pair is None and rec.images:
            assert images is not None
            samples.append(expand_images(next(next_sequence), images[i], image_pad, rec.where))
        elif rec.pair is None:
            samples.append(next(next_sequence))
        else:
            chosen, rejected = share_prompt(next(next_sequence), next(next_sequence))
            samples.append(join_pair(chosen, rejected))
    return samples


def check_system_prompt(cfg: DataConfig) -> None:
    """data.system_prompt holds no vision token, for a model that reads images: each record's
    text is checked so when it is read (memtune.data.readers), and the system prompt goes into
    every record. A ``<|image_pad|>`` there would be taken for an image's token (a record's
    image count off by one; the model's image tokens and features no longer matching)."""
    token = next((t for t in VISION_TOKENS if t in (cfg.system_prompt or "")), None)
    if token is not None:
        raise ConfigError(
            f"data.system_prompt holds {token!r}, which only an image may place (images go "
            "in the records' user turns)"
        )


def image_pad_id(ids: list[int], tokenizer: Any) -> int:
    """The id of ``<|image_pad|>`` (``ids``: what the tokenizer made of that text): one
    token, or the tokenizer is not a vision-language model's."""
    if len(ids) != 1:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ConfigError(
            f"the tokenizer ({name}) has no {IMAGE_PAD} token (it split it into {len(ids)}): "
            "records with images need a Qwen vision-language model's tokenizer"
        )
    return ids[0]


def expand_images(s: Sample, images: Sequence[Resized], image_pad: int, where: str) -> Sample:
    """The sample with each image's one ``<|image_pad|>`` repeated once per merged patch of
    that image (as the processor repeats it), its ``mm_token_type_ids`` and its images."""
    input_ids: list[int] = []
    labels: list[int] = []
    types: list[int] = []
    k = 0
    for token, label in zip(s.input_ids, s.labels, strict=True):
        if token != image_pad:
            input_ids.append(token)
            labels.append(label)
            types.append(MM_TEXT)
            continue
        # Never a label, though data.train_on_prompt labels the rest of the prompt: the
        # patches are the input, not text the model could learn to write.
        n = images[k].tokens
        k += 1
        input_ids += [token] * n
        labels += [IGNORE_INDEX] * n
        types += [MM_IMAGE] * n
    assert k == len(images), f"{where}: {k} image placeholders for {len(images)} images"
    return Sample(input_ids, labels, images=[im.pixels for im in images], mm_token_type_ids=types)


def image_runs(types: Sequence[int]) -> list[tuple[int, int]]:
    """Each image's token span ``[start, end)`` from ``mm_token_type_ids``, in order (two
    images' tokens are never adjacent: ``<|vision_end|><|vision_start|>`` separate them)."""
    runs, start = [], -1
    for i, t in enumerate(types):
        if t == MM_IMAGE and start < 0:
            start = i
        elif t != MM_IMAGE and start >= 0:
            runs.append((start, i))
            start = -1
    if start >= 0:
        runs.append((start, len(types)))
    return runs


def cut(s: Sample, n: int) -> Sample | None:
    """The sample's first ``n`` tokens, with the images wholly before the cut; None when the
    cut falls inside an image's tokens (an image's tokens must all be there: the model puts
    one patch embedding on each)."""
    if s.mm_token_type_ids is None:
        return Sample(s.input_ids[:n], s.labels[:n])
    runs = image_runs(s.mm_token_type_ids)
    if any(a < n < b for a, b in runs):
        return None
    kept = sum(1 for _, b in runs if b <= n)
    return Sample(
        s.input_ids[:n],
        s.labels[:n],
        images=s.images[:kept],
        mm_token_type_ids=s.mm_token_type_ids[:n],
    )


def final_reply_only(rendered: list[Segment]) -> list[Segment]:
    """The segments with only the last label segment (the final reply, with its end marker
    as the template marks it) left a label. Earlier replies stay separate segments, tokenized
    on their own as SFT tokenizes them, so the tokens do not change: only their labels do."""
    last = max(i for i, (_, label) in enumerate(rendered) if label)
    return [(text, label and i == last) for i, (text, label) in enumerate(rendered)]


def join_pair(chosen: Sample, rejected: Sample) -> Sample:
    """One Sample of a pair: chosen's tokens, then rejected's; ``split`` = chosen's length."""
    return Sample(
        chosen.input_ids + rejected.input_ids,
        chosen.labels + rejected.labels,
        split=len(chosen.input_ids),
        index=chosen.index,
    )


def share_prompt(chosen: Sample, rejected: Sample) -> tuple[Sample, Sample]:
    """A pair's two sequences with one prompt: each one's prompt (the tokens before its first
    label) is cut back to the longest prefix the two share, and what it held past that becomes
    labels of its side. Only a pair whose one reply has reasoning and the other none, under
    data.template=qwen3 or qwen3_5, has two prompts: the thinking-off side's holds the empty
    think block, the thinking-on side's stops before the block (qwen3) or after ``<think>\\n``
    (qwen3_5, whose ``<think>\\n\\n`` is other tokens). Cut back, both prompts end where the two
    part (qwen3: after ``<|im_start|>assistant\\n``; qwen3_5: after ``<think>``), and each side
    learns its own rest of the block with its reply: the objectives compare the two replies'
    log-probabilities after the same tokens. The tokens do not change, only labels."""
    starts = [
        next((i for i, t in enumerate(s.labels) if t != IGNORE_INDEX), len(s.labels))
        for s in (chosen, rejected)
    ]
    if starts[0] == starts[1] and chosen.input_ids[: starts[0]] == rejected.input_ids[: starts[0]]:
        return chosen, rejected  # one prompt already: every pair but those above
    shared = 0
    while shared < min(starts) and chosen.input_ids[shared] == rejected.input_ids[shared]:
        shared += 1
    out = []
    for s, start in zip((chosen, rejected), starts, strict=True):
        labels = s.labels[:shared] + s.input_ids[shared:start] + s.labels[start:]
        out.append(s if start == shared else Sample(s.input_ids, labels, index=s.index))
    return out[0], out[1]


def pair_halves(pair: Sample) -> tuple[Sample, Sample]:
    """A pair's (chosen, rejected) sequences, each as its own Sample (``split`` 0)."""
    assert pair.split, "not a preference pair"
    c = pair.split
    chosen = Sample(pair.input_ids[:c], pair.labels[:c], index=pair.index)
    rejected = Sample(pair.input_ids[c:], pair.labels[c:], index=pair.index)
    return chosen, rejected


def n_labels(labels: Sequence[int]) -> int:
    """Label tokens that are targets: the first position never is (labels shift by one)."""
    return sum(1 for t in labels[1:] if t != IGNORE_INDEX)


def apply_length_policy(samples: list[Sample], cfg: DataConfig, stats: DataStats) -> list[Sample]:
    """Truncate, split (long documents) or drop over-long samples, drop samples left without
    labels; count each (``truncated`` counts kept samples only: one cut down to no labels is
    ``truncated_no_labels``, a drop). Preference pairs follow :func:`fit_pair`."""
    kept = []
    n = stats.max_seq_len = cfg.max_seq_len
    pieces: list[tuple[Sample, bool]] = []
    for s in samples:
        if s.split:
            pair = fit_pair(s, cfg, stats)
            if pair is not None:
                kept.append(pair)
            continue
        if len(s.input_ids) > n and cfg.overlong == "split":
            # A long document becomes consecutive max_seq_len pieces, each its own sample
            # (each piece's first token is a target of nothing: labels shift by one).
            parts = [
                Sample(s.input_ids[a : a + n], s.labels[a : a + n])
                for a in range(0, len(s.input_ids), n)
            ]
            if len(parts[-1].input_ids) == 1:
                parts.pop()
                stats.split_remnants += 1
            stats.split += 1
            stats.split_pieces += len(parts)
            pieces += [(part, False) for part in parts]
        else:
            pieces.append((s, len(s.input_ids) > n))
    for s, over in pieces:
        had_labels = n_labels(s.labels) > 0  # before the cut: the cut may be why none are left
        if over:
            if cfg.overlong == "drop":
                stats.dropped_overlong += 1
                continue
            short = cut(s, n)
            if short is None:
                stats.dropped_image_cut += 1
                continue
            s = short
        count = n_labels(s.labels)
        if count == 0:
            if over and had_labels:
                stats.truncated_no_labels += 1
            else:
                stats.dropped_no_labels += 1
            continue
        stats.truncated += over
        stats.samples += 1
        stats.tokens += len(s.input_ids)
        stats.label_tokens += count
        stats.images += len(s.images)
        stats.image_bytes += sum(im.nbytes for im in s.images)
        kept.append(s)
    return kept


def pair_lengths(chosen: int, rejected: int, max_seq_len: int) -> tuple[int, int]:
    """How many tokens of a pair's chosen and rejected sequences to keep so that both fit in
    ``max_seq_len``: the longer one is cut first, down to the other's length, then both
    equally (chosen keeps the odd token). This keeps the shorter of the two as long as any
    cut can, so a pair loses a sequence's last label only when no cut could save it: the two
    share their prompt, and a sequence needs one token past it to have a label."""
    if chosen + rejected <= max_seq_len:
        return chosen, rejected
    shorter = min(chosen, rejected)
    if max_seq_len - shorter >= shorter:  # cutting the longer one alone is enough
        longer = max_seq_len - shorter
        return (longer, shorter) if chosen > rejected else (shorter, longer)
    half = max_seq_len // 2
    return max_seq_len - half, half


def fit_pair(pair: Sample, cfg: DataConfig, stats: DataStats) -> Sample | None:
    """The length policy of a preference pair: its chosen and rejected sequences share one
    packed row, so data.max_seq_len bounds the two together, and a pair is never cut apart.
    overlong=truncate cuts the replies' ends (:func:`pair_lengths`); drop drops the pair. A
    pair left without a label in either sequence is dropped (``truncated_no_labels`` when the
    cut took it, else ``dropped_no_labels``): the objectives need a log-probability of each
    reply. Counts the pair in ``stats``."""
    if cfg.overlong == "split":  # validate refuses it; a caller that skipped validate too
        raise ConfigError("data.overlong=split does not apply to preference pairs")
    stats.max_seq_len = cfg.max_seq_len
    chosen, rejected = pair_halves(pair)
    uncut = 0 not in (n_labels(chosen.labels), n_labels(rejected.labels))
    total = len(pair.input_ids)
    cut = total > cfg.max_seq_len
    if cut and cfg.overlong == "drop":
        stats.dropped_overlong += 1
        return None
    if cut:
        c, r = pair_lengths(len(chosen.input_ids), len(rejected.input_ids), cfg.max_seq_len)
        chosen = Sample(chosen.input_ids[:c], chosen.labels[:c], index=pair.index)
        rejected = Sample(rejected.input_ids[:r], rejected.labels[:r], index=pair.index)
    counts = n_labels(chosen.labels), n_labels(rejected.labels)
    if 0 in counts:
        if cut and uncut:  # the cut took the last labels (else it had none to lose)
            stats.truncated_no_labels += 1
        else:
            stats.dropped_no_labels += 1
        return None
    kept = join_pair(chosen, rejected) if cut else pair
    stats.truncated += cut
    stats.samples += 1
    stats.tokens += len(kept.input_ids)
    stats.label_tokens += sum(counts)
    return kept
