"""Tokenize once, before any rank starts, into a cache keyed by what the result depends on.

The key hashes the data files' bytes, the tokenizer, the template and every length and
filtering setting, so a second run with the same inputs reuses the cache and a changed file
or setting builds a new one. Ranks only read the cache: no rank waits in a collective while
another tokenizes, and a bad record stops the job before any GPU memory is taken.

An entry is sealed with its manifest (memtune.integrity, XXH3-128) and verified whenever it is
reused: a damaged or incomplete one is set aside as ``.damaged-KEY.XXXX`` and tokenized again, with
one line saying so.

Data with images adds every image file's bytes and the image processor's settings to the key,
and four arrays to a split's file: the resized images as uint8 (``image_pixels``, flat;
``image_sizes``, each image's height and width; ``image_offsets``, each sample's first image)
and ``mm_token_type_ids`` per token. ``vision.json`` holds the settings the rank patchifies
them with (:func:`memtune.data.vision.pixel_values`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from memtune.config import ConfigError, DataConfig, DataSource, cache_dir
from memtune.data.encode import (
    DataStats,
    Sample,
    apply_length_policy,
    check_system_prompt,
    encode_records,
    hub_unreachable,
    offline_by,
    resize_record_images,
)
from memtune.data.readers import IdenticalReplies, Record, RecordError, WrongFormat, read_source
from memtune.data.templates import is_query
from memtune.data.tool_calls import TOOL_TEMPLATES, has_tools
from memtune.data.vision import IMAGE_PAD, ImageSettings, Resized
from memtune.filesystem import (
    NO_SPACE,
    cannot_write,
    follow_umask,
    free_bytes,
    human_bytes,
    make_dirs,
    owned_temp_dir,
    refused_by,
    remove_left_by_dead,
    safetensors_write_errors,
    sibling_lock,
)
from memtune.integrity import Store
from memtune.paths import hub_dataset

CACHE_VERSION = 2
"""2: every entry sealed with a manifest (entries of 1 are not looked at: their key differs)."""
BUILDING = ".building-"
"""A build's temporary directory in the cache (``.building-<host>-<pid>-XXXXXXXX``), renamed
to its fingerprint when whole."""

DATA_CACHE = Store("data cache", CACHE_VERSION, required=("train.safetensors", "stats.json"))
"""An entry: train.safetensors, stats.json (the counts), val.safetensors where the settings make
a validation split (data.val_fraction, data.val_path), vision.json for data with images."""
MAX_BAD_EXAMPLES = 5
CHUNK = 2000
VISION_FILE = "vision.json"


@dataclass
class Prepared:
    dir: Path
    train: DataStats
    val: DataStats | None
    reused: bool
    set_aside: str | None = None
    """The line saying a damaged entry under this key was set aside before this one was built."""


def _digest_path(h: Any, path: str) -> None:
    p = Path(path).expanduser()
    if hub_dataset(path) is not None:
        h.update(f"hub:{path}".encode())  # a hub dataset: its name (pin a local copy to be exact)
        return
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode())
        try:
            with f.open("rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
        except OSError as err:
            raise ConfigError(f"{f}: cannot read ({err.strerror})") from err


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
TOKENIZER_FILE_MAX_BYTES = 256 << 20
"""Larger files next to a model are not a tokenizer's (the biggest, Gemma's tokenizer.json,
is ~33 MB): left out of the digest, whatever their suffix."""


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer known by the files it is loaded from, loaded only if the cache has to be
    built: a launch whose data is already tokenized then never imports transformers (and
    torch with it) before its ranks start — ~4 s of a 2-core machine's start-up."""

    digest: str
    load: Callable[[], Any]


def tokenizer_files_digest(name_or_path: str, revision: str | None = None) -> str | None:
    """A digest of every file but the weights next to the model's config.json (a local dir, or
    a hub name in the local Hugging Face cache, at ``revision``: model.revision) — what
    AutoTokenizer reads is among them — and of transformers' version; None when the files
    cannot be found without a download."""
    from importlib.metadata import version

    from memtune.config.architecture import checkpoint_config_file

    config = checkpoint_config_file(name_or_path, revision)  # that snapshot's, not main's
    if config is None:
        return None
    h = hashlib.sha256(f"transformers {version('transformers')}".encode())
    for f in sorted(config.parent.iterdir()):
        if (
            f.is_file()
            and not f.name.endswith(WEIGHT_SUFFIXES)
            and f.stat().st_size <= TOKENIZER_FILE_MAX_BYTES
        ):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return "files:" + h.hexdigest()


def _tokenizer_digest(tokenizer: Any) -> str:
    if isinstance(tokenizer, TokenizerFiles):
        return tokenizer.digest
    return tokenizer.backend_tokenizer.to_str() + str(tokenizer.eos_token)


def _mentions_images(path: str) -> bool:
    """The source's bytes hold ``image`` (every record with images names the field:
    ``"image"`` parts, an ``images`` list, a ``datasets`` Image column): only then are its
    records parsed for the key. A text-only source is not parsed twice per launch."""
    p = Path(path).expanduser()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    for f in files:
        tail = b""
        with f.open("rb") as fh:
            while block := fh.read(1 << 20):
                if b"image" in tail + block:
                    return True
                tail = block[-4:]
    return False


def _digest_images(h: Any, path: str, fmt: str) -> bool:
    """Add every image file a source's records name, bytes and path, in record order (images
    given as bytes in a column are in the source's own bytes already); True when any record
    of the source has an image (a hub dataset: keyed by its name, as for text, and taken to
    have some). A bad record is left to the build, which says what is wrong."""
    if fmt != "messages":
        return False
    if hub_dataset(path) is not None:
        return True  # may hold images: the image settings join the key, unparsed
    if not _mentions_images(path):
        return False
    found = False
    try:
        for item in read_source(path, fmt):
            if isinstance(item, RecordError):
                continue
            for ref in item.images:
                found = True
                if ref.path is not None:
                    h.update(str(ref.path).encode())
                    _digest_path(h, str(ref.path))
    except RecordError:  # the source as a whole (not a JSON array, a damaged file): the build
        pass  # reads it again and stops with its line; no cache entry is made for it
    return found


def fingerprint(
    cfg: DataConfig, tokenizer: Any, seed: int, images: ImageSettings | None = None
) -> str:
    """The cache key: the sources' bytes, the tokenizer (its files' digest, or a loaded
    tokenizer's vocabulary and rules) and every setting that changes what is stored; with
    images, every image's bytes and the image processor's settings (``images``)."""
    h = hashlib.sha256()
    has_images = False
    for src in cfg.all_sources():
        h.update(json.dumps([src.path, src.format, src.weight]).encode())
        _digest_path(h, src.path)
        has_images |= _digest_images(h, src.path, src.format)
    if cfg.val_path:
        _digest_path(h, cfg.val_path)
        has_images |= _digest_images(h, cfg.val_path, cfg.all_sources()[0].format)
    if has_images:
        h.update(f"images {images.as_json() if images else None}".encode())
    h.update(_tokenizer_digest(tokenizer).encode())
    settings = [
        CACHE_VERSION,
        code_digest(),
        cfg.template,
        cfg.system_prompt,
        cfg.train_on_prompt,
        cfg.max_seq_len,
        cfg.overlong,
        cfg.on_bad_record,
        cfg.val_fraction,
        cfg.val_path,
        seed if _seed_draws(cfg) else None,
    ]
    h.update(json.dumps(settings).encode())
    return h.hexdigest()[:20]


def _seed_draws(cfg: DataConfig) -> bool:
    """Whether the seed changes what a build stores: it draws the validation split
    (data.val_fraction without data.val_path) and a fractional weight's records; otherwise
    another trainer.seed reuses the same entry."""
    fractional = any(src.weight != int(src.weight) for src in cfg.all_sources())
    return bool(cfg.val_fraction and not cfg.val_path) or fractional


CODE_FILES = ("readers.py", "templates.py", "tool_calls.py", "encode.py", "vision.py", "cache.py")
"""memtune's own code that turns records into the stored tokens (memtune.data): in the key, so
that an upgrade that renders, labels or splits differently builds anew instead of reusing
entries it would not write."""


@functools.cache
def code_digest() -> str:
    """A digest of :data:`CODE_FILES`' sources; memtune's version where they are not on disk
    (an install of compiled files only)."""
    h = hashlib.sha256()
    try:
        for name in CODE_FILES:
            h.update(name.encode())
            h.update((Path(__file__).parent / name).read_bytes())
    except OSError:
        from importlib.metadata import version

        return f"memtune {version('memtune')}"
    return h.hexdigest()[:16]


def _read(src: DataSource, cfg: DataConfig, stats: DataStats) -> list[Record]:
    if hub_dataset(src.path) is not None:
        _check_hub_reachable(src.path)
    records = []
    try:
        items = list(read_source(src.path, src.format))
    except RecordError as err:  # the source as a whole: unreadable file, not a JSON array…
        raise ConfigError(str(err)) from err
    for item in items:
        if isinstance(item, RecordError):
            _bad_record(item, cfg, stats)
            continue
        records.append(item)
    return records


def _check_hub_reachable(source: str) -> None:
    """A hub dataset's source where the hub cannot be reached: one line at once, not
    ``datasets``' ~30 s of retries and its ConnectionError. With HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE set nothing is probed: ``datasets`` reads its own cache (or says at
    once that it cannot)."""
    if offline_by("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") is not None:
        return
    problem = hub_unreachable()
    # a cached one: datasets falls back to its copy after its retries, as before the probe
    if problem is not None and not _dataset_cached(source):
        raise ConfigError(
            f"{source}: no such file or folder on this machine, and it cannot be loaded as a "
            f"Hugging Face dataset: {problem}; give a file's path, or, where the dataset is in "
            "datasets' cache, set HF_HUB_OFFLINE=1 to read it from there"
        )


def _dataset_cached(source: str) -> bool:
    """Whether ``datasets`` has hub dataset ``source`` in its caches: the hub's files
    (HF_HUB_CACHE, ``datasets--OWNER--NAME``) or its prepared copy (HF_DATASETS_CACHE,
    ``OWNER___NAME``)."""
    from datasets import config as datasets_config
    from huggingface_hub.constants import HF_HUB_CACHE

    hub = hub_dataset(source)
    if hub is None:
        return False
    name = hub[0]
    return (Path(HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}").is_dir() or (
        Path(datasets_config.HF_DATASETS_CACHE) / name.replace("/", "___")
    ).is_dir()


def _bad_record(err: RecordError, cfg: DataConfig, stats: DataStats) -> None:
    """data.on_bad_record: stop with the record's error, or count it and go on."""
    if cfg.on_bad_record == "error" and isinstance(err, WrongFormat):
        raise ConfigError(str(err))  # skipping them would skip the file
    if cfg.on_bad_record == "error":
        raise ConfigError(f"{err} (data.on_bad_record=skip would skip and count such records)")
    stats.skipped_bad += 1
    stats.identical_pairs += isinstance(err, IdenticalReplies)
    examples = stats.bad_examples
    if len(examples) < MAX_BAD_EXAMPLES:
        examples.append(str(err))
        return
    # Full: a kind not shown yet takes the place of the newest example of a kind shown twice,
    # so that the examples show every kind (as far as there is room): records read later (an
    # image decoded after every record was parsed) are not hidden behind the first kind.
    kinds = [_problem_kind(e) for e in examples]
    if _problem_kind(str(err)) in kinds:
        return
    for i in reversed(range(len(examples))):
        if kinds.count(kinds[i]) > 1:
            del examples[i]
            examples.append(str(err))  # in the order they were read
            return


def _problem_kind(example: str) -> str:
    """What a bad record's message says, without where (``file:line: ``) and without the
    values in it (numbers, quoted text): two records with one problem are one kind."""
    problem = example.split(": ", 1)[-1]
    return re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "", problem)


def _weighted(records: list[Record], weight: float, rng: random.Random) -> list[Record]:
    whole, frac = int(weight), weight - int(weight)
    out = records * whole
    if frac:
        out += rng.sample(records, round(frac * len(records)))
    return out


def _encode(
    records: list[Record],
    tokenizer: Any,
    cfg: DataConfig,
    stats: DataStats,
    desc: str,
    images: ImageSettings | None = None,
) -> list[Sample]:
    from tqdm import tqdm

    stray = None  # a vision-language model's <|image_pad|> id: only an image may place it
    if images is not None:
        check_system_prompt(cfg)
        stray = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if not isinstance(stray, int) or stray == tokenizer.unk_token_id:
            stray = None
    samples = []
    with tqdm(total=len(records), desc=desc, unit="rec", disable=len(records) < CHUNK) as bar:
        for start in range(0, len(records), CHUNK):
            chunk = read = records[start : start + CHUNK]
            # The records' own problems first: the resized images are matched to the records
            # by position, so none may be dropped after them (a record after a dropped one
            # took its neighbour's images)
            if cfg.template == "qwen3_5":
                chunk = _with_a_query(chunk, cfg, stats)
            if cfg.template not in TOOL_TEMPLATES:
                chunk = _kept(chunk, chunk, _tool_use, cfg, stats)
            resized = None
            if images is not None and any(rec.images for rec in chunk):
                chunk, resized = _resize_images(chunk, images, cfg, stats)
            encoded = encode_records(chunk, tokenizer, cfg, resized)
            if stray is not None:
                encoded = _without_stray_image_tokens(chunk, encoded, stray, cfg, stats)
            samples += apply_length_policy(encoded, cfg, stats)
            _check_image_budget(stats, cfg)
            bar.update(len(read))
    return samples


T = TypeVar("T")


def _kept(
    chunk: list[Record],
    items: list[T],
    bad: Callable[[T], str | None],
    cfg: DataConfig,
    stats: DataStats,
) -> list[T]:
    """``items`` (one a record of ``chunk``) but those ``bad`` has a reason for: each a bad
    record (data.on_bad_record), no longer counted among the records read."""
    kept = []
    for rec, item in zip(chunk, items, strict=True):
        why = bad(item)
        if why is None:
            kept.append(item)
            continue
        _bad_record(RecordError(rec.where, why), cfg, stats)
        stats.records -= 1
    return kept


NO_QUERY = (
    "no user turn is a query (each is a tool result wrapped in <tool_response>): Qwen3.5's chat "
    "template refuses such a conversation (data.template=qwen3_5)"
)


def _tool_use(rec: Record) -> str | None:
    """Why a record is bad under a template without a tool format (data.template=plain)."""
    conversations = list(rec.conversations()) if rec.pair is not None else [rec.messages or []]
    if not any(has_tools(c, rec.tools) for c in conversations):
        return None
    templates = ", ".join(TOOL_TEMPLATES)
    return f"the record uses tools and data.template has no tool format: set one of {templates}"


def _with_a_query(chunk: list[Record], cfg: DataConfig, stats: DataStats) -> list[Record]:
    """The records but those with a conversation whose every user turn is a tool result
    (wrapped whole in <tool_response>): Qwen3.5's template refuses one ("No user query found
    in messages"), so data.template=qwen3_5 takes it for a bad record (data.on_bad_record)."""

    def no_query(rec: Record) -> str | None:
        if rec.pair is not None:
            conversations = list(rec.conversations())
        else:
            conversations = [] if rec.messages is None else [rec.messages]
        return NO_QUERY if any(not any(map(is_query, c)) for c in conversations) else None

    return _kept(chunk, chunk, no_query, cfg, stats)


def _without_stray_image_tokens(
    chunk: list[Record], encoded: list[Sample], image_pad: int, cfg: DataConfig, stats: DataStats
) -> list[Sample]:
    """The samples (one a record) but those of records whose text holds ``<|image_pad|>``
    without an image to place it (formats text, alpaca, preference: only messages records are
    checked as they are read), which are bad records (data.on_bad_record): a vision-language
    model takes the token for an image's, and a step with images then stops on the rank
    (transformers: "Image features and image tokens do not match")."""
    stray = (
        f"the text holds {IMAGE_PAD!r}, which only an image may place (images are read in "
        "data.format=messages records)"
    )

    def placed_by_nothing(s: Sample) -> str | None:
        return stray if s.mm_token_type_ids is None and image_pad in s.input_ids else None

    return _kept(chunk, encoded, placed_by_nothing, cfg, stats)


def _resize_images(
    chunk: list[Record], images: ImageSettings, cfg: DataConfig, stats: DataStats
) -> tuple[list[Record], list[list[Resized]]]:
    """Each record's images read and resized; a record with a bad image is a bad record
    (data.on_bad_record), no longer counted among the records read."""
    kept, resized = [], []
    for rec in chunk:
        try:
            resized.append(resize_record_images(rec, images) if rec.images else [])
        except RecordError as err:
            _bad_record(err, cfg, stats)
            stats.records -= 1
            continue
        kept.append(rec)
    return kept, resized


def _check_image_budget(stats: DataStats, cfg: DataConfig) -> None:
    """The resized images stay under data.image_cache_gb: the build holds them in memory
    before it writes them, and the cache keeps them (see the setting's docstring)."""
    budget = cfg.image_cache_gb * 2**30
    if stats.image_bytes > budget:
        raise ConfigError(
            f"data: the resized images pass data.image_cache_gb={cfg.image_cache_gb:g} after "
            f"{stats.images:,} images ({stats.image_bytes / 2**30:.2f} GiB as uint8): lower "
            "data.max_pixels (each image's resized size; its tokens shrink with it), or raise "
            "data.image_cache_gb if this machine and the cache's disk hold them"
        )


if TYPE_CHECKING:  # torch is imported where tensors are made: a cached launch needs none
    import numpy as np
    import torch

    from memtune.data.batching import TokenizedDataset

Arrays = dict[str, "torch.Tensor"]


def build(
    cfg: DataConfig, tokenizer: Any, seed: int, images: ImageSettings | None = None
) -> tuple[Arrays, DataStats, Arrays | None, DataStats | None]:
    """Read, split and tokenize: (train arrays, train counts, val arrays, val counts).
    ``images``: the model's image processor settings (None: a text-only model)."""
    rng = random.Random(seed)
    pairs = any(src.format == "preference" for src in cfg.all_sources())
    stats = DataStats(preference=pairs)
    # (source, record) in reading order: the validation split is taken from the records as
    # read, before the weights repeat or thin the training part, so that no record (no copy
    # of one) is on both sides and val_fraction is a fraction of the data's own records.
    tagged = [(i, r) for i, src in enumerate(cfg.all_sources()) for r in _read(src, cfg, stats)]
    val_records: list[Record] = []
    val_stats = DataStats(preference=pairs) if has_validation(cfg) else None
    if cfg.val_path:
        fmt = cfg.all_sources()[0].format
        assert val_stats is not None
        val_records = _read(DataSource(path=cfg.val_path, format=fmt), cfg, val_stats)
    elif cfg.val_fraction:
        rng.shuffle(tagged)
        n_val = max(1, round(cfg.val_fraction * len(tagged)))
        val_records, tagged = [r for _, r in tagged[:n_val]], tagged[n_val:]
    records: list[Record] = []
    if all(src.weight == 1 for src in cfg.all_sources()):
        records = [r for _, r in tagged]
    else:
        for i, src in enumerate(cfg.all_sources()):
            records += _weighted([r for j, r in tagged if j == i], src.weight, rng)
    stats.records = len(records)
    train = _encode(records, tokenizer, cfg, stats, "tokenize train", images)
    if not train:
        raise ConfigError(
            f"data: no usable training samples left ({stats.line()}){stats.length_hint()}"
        )
    val = None
    if val_stats is not None:
        val_stats.records = len(val_records)
        val_samples = _encode(val_records, tokenizer, cfg, val_stats, "tokenize val", images)
        if not val_samples:
            raise ConfigError(
                f"data: the validation split is empty ({val_stats.line()}){val_stats.length_hint()}"
            )
        val = _arrays(val_samples)
    return _arrays(train), stats, val, val_stats


def _arrays(samples: list[Sample]) -> Arrays:
    from memtune.data.batching import TokenizedDataset

    ds = TokenizedDataset.from_samples(samples)
    arrays = {"input_ids": ds.input_ids, "labels": ds.labels, "offsets": ds.offsets}
    if ds.splits is not None:
        arrays["splits"] = ds.splits
    if any(s.images for s in samples):
        arrays.update(_image_arrays(samples))
    return arrays


def _image_arrays(samples: list[Sample]) -> Arrays:
    """The samples' images as four flat arrays (see the module docstring): uint8 pixels, not
    the float32 patches (8 times the bytes), patchified on the rank."""
    import numpy as np
    import torch

    types = [t for s in samples for t in (s.mm_token_type_ids or [0] * len(s.input_ids))]
    images = [im for s in samples for im in s.images]
    counts = [0] + [len(s.images) for s in samples]
    sizes = [im.shape[1:] for im in images]
    return {
        "mm_token_type_ids": torch.tensor(types, dtype=torch.uint8),
        "image_pixels": torch.from_numpy(np.concatenate([im.reshape(-1) for im in images])),
        "image_sizes": torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2),
        "image_offsets": torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0),
    }


def image_starts(prepared_dir: str | Path, split: str) -> np.ndarray:
    """Where each image of the split starts in its ``image_pixels`` (one entry more than its
    images: the last is the end), from ``image_sizes`` in one read and one cumulative sum:
    what :func:`load_images` slices by (read once a split and reader: :class:`CachedImages`)."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(Path(prepared_dir) / f"{split}.safetensors"), framework="np") as f:
        sizes = f.get_tensor("image_sizes").astype(np.int64, copy=False).reshape(-1, 2)
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(3 * sizes[:, 0] * sizes[:, 1], out=starts[1:])
    return starts


def load_images(
    prepared_dir: str | Path, split: str, index: int, starts: np.ndarray | None = None
) -> list[Any]:
    """Sample ``index``'s resized images (``3 × H × W`` uint8 numpy arrays), read from the
    split's file without loading the others (the rank's loader reads one sample at a time).
    ``starts``: the split's :func:`image_starts` (read here when not given); reading every
    earlier image's size for each sample made an epoch quadratic in its images."""
    from safetensors import safe_open

    with safe_open(str(Path(prepared_dir) / f"{split}.safetensors"), framework="np") as f:
        if "image_offsets" not in set(f.keys()):
            return []
        first, last = (int(x) for x in f.get_slice("image_offsets")[index : index + 2])
        if first == last:
            return []
        if starts is None:
            starts = image_starts(prepared_dir, split)
        sizes = f.get_slice("image_sizes")[first:last].tolist()
        pixels = f.get_slice("image_pixels")[int(starts[first]) : int(starts[last])]
    out = []
    for (h, w), at in zip(sizes, (starts[first:last] - starts[first]).tolist(), strict=True):
        out.append(pixels[at : at + 3 * h * w].reshape(3, h, w))
    return out


def load_image_settings(prepared_dir: str | Path) -> ImageSettings | None:
    """The image processor settings the cache's images were resized with (None: no images)."""
    path = Path(prepared_dir) / VISION_FILE
    if not path.is_file():
        return None
    fields = json.loads(path.read_text())
    for key in ("image_mean", "image_std"):
        fields[key] = tuple(fields[key])
    return ImageSettings(**fields)


def has_validation(cfg: DataConfig) -> bool:
    """Whether the settings make a validation split (data.val_path, or data.val_fraction)."""
    return bool(cfg.val_fraction or cfg.val_path)


def preprocess(
    cfg: DataConfig, tokenizer: Any, seed: int, images: ImageSettings | None = None
) -> Prepared:
    """Build the cache for ``cfg`` unless it exists and verifies; returns where it is and its
    counts. ``tokenizer``: a loaded tokenizer, or :class:`TokenizerFiles` (loaded only to
    build). ``images``: the model's image processor settings, for records with images (None:
    the model reads no images, and such a record stops the build). A damaged entry is set
    aside and built again (:attr:`Prepared.set_aside`).

    One job at a time builds (or sets aside) an entry (:func:`one_build`): two jobs on the
    same data started together both tokenized it, each holding all of it in memory and
    writing a whole copy beside the cache (twice the disk a build needs), and the second's
    rename failed onto the first's entry; now the second waits, with one line, and reuses
    the first's. Jobs reusing a verified entry take no lock."""
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_dir() / "data"
    out = root / fingerprint(cfg, tokenizer, seed, images)
    if out.is_dir() and DATA_CACHE.problem(out, required=_required(cfg)) is None:
        saved = _saved_stats(out, has_validation(cfg))
        if isinstance(saved, Prepared):
            return saved
    with one_build(root, out):
        # what another job built while this one waited is found (and verified) here
        return _prepare(cfg, tokenizer, seed, images, root, out)


def _required(cfg: DataConfig) -> tuple[str, ...]:
    """The files an entry holds besides :data:`DATA_CACHE`'s, by the settings."""
    return ("val.safetensors",) if has_validation(cfg) else ()


@contextlib.contextmanager
def one_build(root: Path, out: Path) -> Iterator[None]:
    """Hold the build of entry ``out`` (:func:`memtune.filesystem.sibling_lock`: ``.KEY.lock``
    beside it); a second job waits for it with one line. Where the lock cannot be had the
    build goes on unguarded, as before: both build, and the rename keeps one entry."""
    with contextlib.suppress(OSError):  # else unguarded; the build itself says why
        make_dirs(root)
    line = f"memtune: another job is tokenizing the same data into {out}: waiting for it, to "
    with sibling_lock(out, line + "reuse what it builds"):
        yield


def _prepare(
    cfg: DataConfig,
    tokenizer: Any,
    seed: int,
    images: ImageSettings | None,
    root: Path,
    out: Path,
) -> Prepared:
    """:func:`preprocess` under the entry's build lock: reuse, or set aside, and build."""
    where = "data.cache_dir" if cfg.cache_dir else "data.cache_dir (or MEMTUNE_CACHE_DIR)"
    aside_line = None
    has_val = has_validation(cfg)
    required = _required(cfg)
    if out.exists() or out.is_symlink():
        # a symlink that leads nowhere (or round a loop) is damage too: the build's rename onto
        # it failed, "cannot use CACHE/.building-XXXX (NotADirectoryError)", a name gone by then
        problem = (
            DATA_CACHE.problem(out, required=required)
            if out.exists()
            else "a symlink that leads nowhere"
        )
        if problem is None:
            saved = _saved_stats(out, has_val)
            if isinstance(saved, Prepared):
                return saved
            problem = saved
        try:
            aside = DATA_CACHE.set_aside(out)
        except OSError as err:
            raise ConfigError(
                f"data cache {out} is damaged ({problem}) and cannot be set aside "
                f"({err.strerror}{refused_by(out, err)}): point {where} at a folder memtune "
                "can write"
            ) from None
        aside_line = DATA_CACHE.damaged_line(out, problem, aside, "tokenizing again")

    unwritable = cannot_write(root)
    if unwritable:
        raise ConfigError(f"{where}: {unwritable}; point it at a folder memtune can write")
    if isinstance(tokenizer, TokenizerFiles):
        tokenizer = tokenizer.load()
    train, stats, val, val_stats = build(cfg, tokenizer, seed, images)
    with no_space_is_an_error(root, where), cannot_write_is_an_error(where):
        make_dirs(root)
        # A build killed before its rename (kill -9, the OOM killer) left a whole data set
        # there, one per kill, which nothing else would ever remove.
        remove_left_by_dead(root, BUILDING, "a data cache build")
        tmp = owned_temp_dir(root, BUILDING)
    try:
        with no_space_is_an_error(out, where):
            try:
                _save(train, tmp / "train.safetensors")
                if val is not None:
                    _save(val, tmp / "val.safetensors")
                if images is not None and any("image_pixels" in a for a in (train, val or {})):
                    (tmp / VISION_FILE).write_text(images.as_json() + "\n")
                payload = {"train": stats.as_dict(), "val": val_stats and val_stats.as_dict()}
                (tmp / "stats.json").write_text(json.dumps(payload, indent=2) + "\n")
                DATA_CACHE.seal(tmp)  # last: an entry without its manifest is never reused
            except OSError as err:
                # named for the entry, not the build's temporary dir (removed below)
                raise type(err)(err.errno, err.strerror, str(out)) from err
        follow_umask(tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            if DATA_CACHE.problem(out, required=required) is not None:  # not a concurrent build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: a build cut short leaves nothing
    return Prepared(out, stats, val_stats, reused=False, set_aside=aside_line)


def _saved_stats(out: Path, has_val: bool) -> Prepared | str:
    """A verified entry's counts as :class:`Prepared` (reused), or what is wrong with its
    stats.json: listed and verified, it holds what a build wrote, unless an older or a foreign
    writer made it (then it is damage like any other, set aside and tokenized again)."""
    path = out / "stats.json"
    try:
        saved = json.loads(path.read_text())
        train = DataStats(**saved["train"])
        val = DataStats(**saved["val"]) if saved["val"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path} does not hold the counts of a split"
    if has_val != (val is not None):
        return f"{path} does not hold the counts of a split"
    return Prepared(out, train, val, reused=True)


@contextlib.contextmanager
def cannot_write_is_an_error(fix: str) -> Iterator[None]:
    """A cache folder memtune may not write (read-only filesystem, no permission): one line
    naming it and the setting that moves it, instead of a traceback."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise ConfigError(
            f"cannot write {err.filename}: {err.strerror}; point {fix} at a folder memtune "
            "can write"
        ) from None


def _save(arrays: Arrays, path: Path) -> None:
    """safetensors' save_file, its I/O error an OSError again (safetensors_write_errors)."""
    from safetensors.torch import save_file

    with safetensors_write_errors(path):
        save_file(arrays, str(path))


def free_space(path: Path) -> str:
    """``free_bytes`` for a message."""
    free = free_bytes(path)
    return "unknown space" if free is None else human_bytes(free)


def no_space_message(err: OSError, where: Path, fix: str) -> str:
    """One line: which path could not be written, why, how much room its filesystem has, and
    which setting moves it (``fix``)."""
    path = err.filename or where
    why = NO_SPACE.get(err.errno or 0, err.strerror)
    return (
        f"cannot write {path}: {why} ({free_space(Path(path))} free there); "
        f"free space, or point {fix} at a filesystem with room"
    )


@contextlib.contextmanager
def no_space_is_an_error(where: Path, fix: str) -> Iterator[None]:
    """Turn a full disk (ENOSPC, EDQUOT, EFBIG) while writing under ``where`` into a
    ConfigError naming the path, the free space and the setting ``fix`` that moves it: the job
    stops before launch with one line (exit 2) instead of a traceback. Other errors pass."""
    try:
        yield
    except OSError as err:
        if err.errno not in NO_SPACE:
            raise
        raise ConfigError(no_space_message(err, where, fix)) from None


def load_lengths(prepared_dir: str | Path, split: str = "train") -> list[int]:
    """The samples' token counts of a split, read from its offsets alone (not the tokens)."""
    from safetensors import safe_open

    # numpy, not torch: the launcher reads them before any rank starts
    with safe_open(str(Path(prepared_dir) / f"{split}.safetensors"), framework="np") as f:
        offsets = f.get_tensor("offsets")
    return (offsets[1:] - offsets[:-1]).tolist()


IMAGE_ARRAYS = ("image_pixels", "image_sizes", "image_offsets")
"""A split's image arrays: read a sample at a time (:class:`CachedImages`), never whole."""


class CachedImages:
    """A split's images, sample by sample: ``images[i]`` is sample i's resized images, read
    from the cache's file when asked (:func:`load_images`), so a rank holds no more of them
    than its current batches (the split's may be gigabytes: data.image_cache_gb)."""

    def __init__(self, prepared_dir: str | Path, split: str):
        self.prepared_dir, self.split = str(prepared_dir), split
        self.starts: np.ndarray | None = None
        """The split's :func:`image_starts`, read at the first sample (in each loader worker
        that reads before it has them) and kept."""

    def __getitem__(self, index: int) -> list[Any]:
        if self.starts is None:
            self.starts = image_starts(self.prepared_dir, self.split)
        return load_images(self.prepared_dir, self.split, index, self.starts)


def load_split(prepared_dir: str | Path, split: str = "train") -> TokenizedDataset:
    """A split's samples: the token arrays in memory, images (data with images) read with each
    sample (:class:`CachedImages`)."""
    from safetensors import safe_open

    from memtune.data.batching import TokenizedDataset

    with safe_open(str(Path(prepared_dir) / f"{split}.safetensors"), framework="pt") as f:
        names = set(f.keys())
        arrays = {k: f.get_tensor(k) for k in names if k not in IMAGE_ARRAYS}
    images = CachedImages(prepared_dir, split) if "image_offsets" in names else None
    return TokenizedDataset(
        arrays["input_ids"],
        arrays["labels"],
        arrays["offsets"],
        arrays.get("splits"),
        arrays.get("mm_token_type_ids"),
        images,
    )
