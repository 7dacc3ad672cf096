"""Records → token ids and labels (the template's label mask), and the length policy.

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
from typing import Any
from urllib.parse import urlsplit

from memtune.config import ConfigError, DataConfig, RunConfig
from memtune.data.readers import Record
from memtune.data.templates import segments, with_system

IGNORE_INDEX = -100


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]


@dataclass
class DataStats:
    records: int = 0
    skipped_bad: int = 0
    bad_examples: list[str] = field(default_factory=list)
    truncated: int = 0
    split: int = 0  # over-long documents cut into max_seq_len pieces (data.overlong=split)
    split_pieces: int = 0
    dropped_overlong: int = 0
    dropped_no_labels: int = 0
    samples: int = 0
    tokens: int = 0
    label_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def line(self) -> str:
        out = (
            f"{self.samples} samples from {self.records} records, {self.tokens:,} tokens "
            f"({self.label_tokens:,} labels); truncated {self.truncated}, dropped "
            f"{self.dropped_overlong} over-long + {self.dropped_no_labels} without labels"
        )
        if self.split:
            out += f"; split {self.split} over-long documents into {self.split_pieces} pieces"
        if self.skipped_bad:
            out += f"; skipped {self.skipped_bad} bad records (first: {self.bad_examples[0]})"
        return out


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
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").upper() in _TRUE:
            reason = f"{var} is set, so nothing is downloaded"
            break
    else:
        problem = _hub_unreachable()
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


def _hub_unreachable() -> str | None:
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


def encode_records(records: Sequence[Record], tokenizer: Any, cfg: DataConfig) -> list[Sample]:
    """Tokenize rendered segments in one batch call (the fast tokenizer runs it in parallel)."""
    eos = tokenizer.eos_token
    rendered: list[list[tuple[str, bool]]] = []
    for rec in records:
        if rec.text is not None:
            rendered.append([(rec.text + eos, True)])
        else:
            assert rec.messages is not None
            msgs = with_system(rec.messages, cfg.system_prompt)
            rendered.append(segments(msgs, cfg.template, eos))
    flat = [text for segs in rendered for text, _ in segs]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    samples, k = [], 0
    for segs in rendered:
        input_ids: list[int] = []
        labels: list[int] = []
        for _, is_label in segs:
            piece = ids[k]
            k += 1
            input_ids += piece
            labels += piece if (is_label or cfg.train_on_prompt) else [IGNORE_INDEX] * len(piece)
        samples.append(Sample(input_ids, labels))
    return samples


def n_labels(labels: Sequence[int]) -> int:
    """Label tokens that are targets: the first position never is (labels shift by one)."""
    return sum(1 for t in labels[1:] if t != IGNORE_INDEX)


def apply_length_policy(samples: list[Sample], cfg: DataConfig, stats: DataStats) -> list[Sample]:
    """Truncate, split (long documents) or drop over-long samples, drop samples left without
    labels; count each (``truncated`` counts kept samples only: one cut down to no labels is
    a drop)."""
    kept = []
    n = cfg.max_seq_len
    pieces: list[tuple[Sample, bool]] = []
    for s in samples:
        if len(s.input_ids) > n and cfg.overlong == "split":
            # A long document becomes consecutive max_seq_len pieces, each its own sample
            # (each piece's first token is a target of nothing: labels shift by one).
            parts = [
                Sample(s.input_ids[a : a + n], s.labels[a : a + n])
                for a in range(0, len(s.input_ids), n)
            ]
            stats.split += 1
            stats.split_pieces += len(parts)
            pieces += [(part, False) for part in parts]
        else:
            pieces.append((s, len(s.input_ids) > n))
    for s, cut in pieces:
        if cut:
            if cfg.overlong == "drop":
                stats.dropped_overlong += 1
                continue
            s = Sample(s.input_ids[:n], s.labels[:n])
        count = n_labels(s.labels)
        if count == 0:
            stats.dropped_no_labels += 1
            continue
        stats.truncated += cut
        stats.samples += 1
        stats.tokens += len(s.input_ids)
        stats.label_tokens += count
        kept.append(s)
    return kept
