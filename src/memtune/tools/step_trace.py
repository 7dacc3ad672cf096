"""One training step of the full-size model on fake tensors: the planner checked without a GPU.

A tool, not planner code: it builds the model with the rank's own code (rank.model, rank.loss).

    memtune trace experiment=qwen2.5-7b-4x4090-lora [data.max_seq_len=32768]

The model is built by memtune's own code — the architecture on the meta device, then
``rank.model.add_lora`` (activation checkpointing of the planned layers, peft, adapters cast to
the compute dtype) — and its parameters become fake tensors (``FakeTensorMode``: shapes and
dtypes, no storage), so Qwen2.5-7B at 32k tokens traces in seconds on a laptop. Forward through
memtune's loss module and backward run for real, op by op; a dispatch mode (:class:`Tracker`)
records every storage an op creates and forgets it when the storage dies, so the peak of live
bytes, and what is live at that moment, is what the step holds — the same accounting a CUDA
caching allocator's ``max_memory_allocated`` reports, before rounding.

What fake tensors cannot show stays analytical in the planner: ZeRO's partitioning and gathers,
4-bit / int8 storage (a quantized base is traced in the compute dtype: its activations are the
same), the optimizer state, DeepSpeed's buckets, allocator fragmentation and the CUDA context.

A run on images traces the same way (the vision-language class, the planned images written into
the row): the few values such a step reads — the tower's per-image boundaries, the 3-D rotary
positions, the placeholder check — come from the batch's ids, token types and grids, which are
fake-tensor constants here (:func:`_known_values`, :func:`_computed_on_values`).

Construction order matters (torch 2.13): a module's ``.to()`` or peft's adapter placement on
parameters that are already fake goes through ``torch.utils.swap_tensors``, which refuses the
fake mode's weak-referenced tensors ("Couldn't swap Linear.weight"). So everything is built and
cast on the meta device and only then swapped for fake tensors, inside the mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from memtune.config import RunConfig
from memtune.config.decisions import Decisions
from memtune.expert_stacks import expert_modules, experts_state
from memtune.memory.counts import arch_config
from memtune.memory.vision import as_on_cuda
from memtune.rank import attention
from memtune.rank.kernels import use_fused_kernels
from memtune.rank.layers import decoder_layers
from memtune.rank.linear_attention import keep_samples_apart
from memtune.rank.loss import CausalLMLoss
from memtune.rank.model import add_lora, torch_dtype

MIB = 1024**2


class Tracker(TorchDispatchMode):
    """Live bytes of every storage the traced ops create, by category, and their peak.

    Each output's untyped storage is counted once (views share it) and released by a
    ``weakref.finalize`` when the storage dies. ``phase`` (forward, loss, backward) and
    ``where`` (the decoder layer running) are set from module hooks.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}
        self.by_category: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.peak_phase = self.peak_where = ""
        self.phase, self.where = "setup", ""
        self.not_counted: set[int] = set()  # storages the step holds already under another key

    def _category(self) -> str:
        if self.phase == "backward":
            # Under non-reentrant checkpointing the recomputed forward runs with grad enabled.
            return "recompute" if torch.is_grad_enabled() else "backward temporaries"
        return self.phase

    def _release(self, key: int) -> None:
        nbytes, category = self.live.pop(key)
        self.by_category[category] -= nbytes
        self.total -= nbytes

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.not_counted:
            return
        if key in self.live:
            if category is not None:  # re-label (a gradient accumulated into a new tensor)
                nbytes, old = self.live[key]
                self.by_category[old] -= nbytes
                self.by_category[category] += nbytes
                self.live[key] = (nbytes, category)
            return
        nbytes = storage.nbytes()
        category = category or self._category()
        self.live[key] = (nbytes, category)
        self.by_category[category] += nbytes
        self.total += nbytes
        weakref.finalize(storage, self._release, key)
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = {k: v for k, v in self.by_category.items() if v}
            self.peak_phase, self.peak_where = self.phase, self.where

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out


@dataclass
class Trace:
    """One traced step (bytes)."""

    tokens: int
    peak: int
    at_peak: dict[str, int]
    peak_phase: str
    peak_where: str
    saved_after_forward: int  # non-parameter bytes alive between forward and backward
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def parameters(self) -> int:
        return self.at_peak.get("base weights", 0) + self.at_peak.get("LoRA weights", 0)

    @property
    def step(self) -> int:
        """What the step adds to the weights at its peak: activations, loss buffers,
        temporaries and the gradients accumulated so far."""
        return self.peak - self.parameters


def traced_decisions(cfg: RunConfig, d: Decisions) -> tuple[Decisions, list[str]]:
    """The decisions the trace builds with: a quantized base in the compute dtype (fake
    tensors have no 4-bit storage; the activations do not change), SDPA for the CUDA-only
    attention kernels (FlashAttention-2, torch_varlen: one call a row keeping the output and a
    logsumexp, as SDPA over an unpacked row does; sdpa_varlen is traced as itself), the
    chunked loss unless plain."""
    from memtune.config import ConfigError

    if d.sequence_parallel > 1 or d.tiled_mlp or d.offload_activations:
        raise ConfigError(
            "the trace runs one process without the long-context autograd functions: set "
            "trainer.sequence_parallel=1 trainer.tiled_mlp=off trainer.offload_activations=off "
            "(tests/test_plan.py checks those plans against what autograd saves instead)"
        )
    notes = []
    if cfg.trainer.objective != "sft":
        # rank.preference's pair losses are not traced: the row, the model and its backward
        # are the same, the loss at the end is SFT's cross-entropy
        notes.append(
            f"trainer.objective={cfg.trainer.objective} traced as sft (the row's cross-entropy, "
            f"not {cfg.trainer.objective}'s pair log-probabilities: the plan's loss row is "
            f"{cfg.trainer.objective}'s)"
        )
    if d.peft_method != "lora":
        notes.append(f"{d.peft_method} base traced in {cfg.trainer.precision} (analytical)")
        experts = d.experts and dataclasses.replace(d.experts, storage="compute")
        d = dataclasses.replace(d, peft_method="lora", experts=experts)
    if d.attention not in ("sdpa", "eager", "sdpa_varlen"):
        d = dataclasses.replace(d, attention="sdpa", attention_by_kv_head=False)
    if d.loss != "plain":
        d = dataclasses.replace(d, loss="chunked")
    if d.kernels.fused():
        # Liger's RMSNorm and SwiGLU keep what the lean ones keep (the input and a per-row
        # inverse RMS; gate and up); its rotary is Triton, traced as transformers' ops
        notes.append(f"Liger's {' + '.join(d.kernels.fused())} traced as lean / torch")
        k = d.kernels
        kernels = dataclasses.replace(
            k,
            rms_norm="lean" if k.rms_norm == "liger" else k.rms_norm,
            swiglu="lean" if k.swiglu == "liger" else k.swiglu,
            rope="torch",
        )
        d = dataclasses.replace(d, kernels=kernels)
    return d, notes


def every_position(
    hidden_BTH: torch.Tensor, targets_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """All positions but the last (which predicts nothing) are labels — the planner's worst
    case — selected as a copy like the real boolean selection (whose size depends on the data,
    which fake tensors do not have)."""
    h = hidden_BTH.shape[-1]
    return hidden_BTH[:, :-1].reshape(-1, h).clone(), targets_BT[:, :-1].reshape(-1)


def packed_rows(micro: int, seq: int) -> dict[str, torch.Tensor]:
    """What a packed batch marks its samples with (data.batching.collate_packed), for rows of
    two samples each: sdpa_varlen attends over each sample in its own call and concatenates
    their outputs, which a row of one sample would not. The boundaries are constants (their
    values are read); the positions' values are not."""
    half = seq // 2
    starts = [r * seq + a for r in range(micro) for a in (0, half)]
    return {
        "position_ids": torch.zeros((micro, seq), dtype=torch.long),
        "cu_seq_lens": torch.tensor([*starts, micro * seq], dtype=torch.int32),
        "max_length": torch.tensor(seq - half),
    }


@contextlib.contextmanager
def _unpacked_mask() -> Iterator[None]:
    """transformers treats fake tensors as a compiler trace and so cannot rule out packed rows
    from the positions: it would build a dense [T, T] mask that a real unpacked batch never
    has. Tell it what a real unpacked batch tells it (no packed sequences)."""
    import transformers.masking_utils as masking

    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _fakeify(module: torch.nn.Module) -> None:
    """Inside a FakeTensorMode: every meta parameter and buffer becomes a fake tensor of the
    same shape and dtype (``to_empty`` would feed meta tensors to the mode as real inputs)."""
    made: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                    )
                m._parameters[name] = made[id(p)]  # type: ignore[assignment]
        for name, b in list(m._buffers.items()):
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = torch.empty(b.shape, dtype=b.dtype)
                m._buffers[name] = made[id(b)]


def trace_step(
    cfg: RunConfig, d: Decisions, fake: bool = True, tracker: Tracker | None = None
) -> Trace:
    """Trace one micro batch (the decided micro batch × max_seq_len tokens, every position a
    label) forward and backward through memtune's model and loss; see the module docstring.
    ``fake=False`` runs the same step on real (uninitialised) CPU tensors: for small models,
    to check the tracker against torch's own accounting. ``tracker``: a :class:`Tracker`
    that records more of each op (the tests' census of what a recompute reads and writes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    d, notes = traced_decisions(cfg, d)
    attention.register()  # sdpa_varlen, as a rank registers it
    dtype = torch_dtype(cfg)
    with torch.device("meta"):
        if d.vision is not None:
            model = vision_language_model(cfg, d)
        else:
            model = AutoModelForCausalLM.from_config(
                arch_config(cfg), attn_implementation=d.attention
            )
    model.to(dtype)
    model.config.use_cache = False
    model = add_lora(model, cfg, d)
    use_fused_kernels(model, d.kernels, torch.device("cpu"))  # the lean kernels, if decided
    attention.split_by_kv_head(model.get_base_model(), d.attention_by_kv_head)
    keep_samples_apart(model.get_base_model())  # a hybrid's linear attention, as a rank runs it
    for _, experts in expert_modules(model):
        experts_state(experts).even_routing = True  # see rank.experts._routed_rows
    as_on_cuda(model)  # the trace stands for a GPU rank
    model.train()
    loss_module = CausalLMLoss(model, d.loss, cfg.trainer.loss_chunk_tokens)
    loss_module.select = every_position
    if tracker is None:
        tracker = Tracker()
    base = model.get_base_model()
    for i, layer in enumerate(decoder_layers(model)):
        here = f"layer {i}"
        # Forward and recompute: the layer's first submodule runs in both.
        first = next(iter(layer.children()), layer)
        first.register_forward_pre_hook(lambda *_, here=here: setattr(tracker, "where", here))

        def on_output(module: Any, args: Any, out: Any, here: str = here) -> None:
            # Backward: the gradient of the layer's output arrives when its backward starts.
            hidden = out[0] if isinstance(out, tuple) else out
            if tracker.phase == "forward" and hidden.requires_grad:
                hidden.register_hook(lambda grad: setattr(tracker, "where", here))

        layer.register_forward_hook(on_output)

    def to_loss(module: Any, args: Any, out: Any) -> None:
        tracker.phase = tracker.where = "loss"
        if out.last_hidden_state.requires_grad:  # its gradient starts the final norm's backward
            out.last_hidden_state.register_hook(lambda g: setattr(tracker, "where", "final norm"))

    base.get_decoder().register_forward_hook(to_loss)
    micro, seq = d.batch.micro_batch, d.batch.row_tokens
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    packed = cfg.data.packing and d.attention == "sdpa_varlen" and d.vision is None
    known: Any = contextlib.nullcontext()
    if d.vision is not None:
        known = _known_values(micro * seq)
    elif packed:
        known = _known_values(2 * micro + 1)  # the packed rows' boundaries
    with mode, _unpacked_mask(), known, contextlib.ExitStack() as stack:
        if fake:
            _fakeify(model)
            if d.vision is not None:
                stack.enter_context(_computed_on_values(model, tracker))
        else:
            model.to_empty(device="cpu")
            with torch.no_grad():  # uninitialised memory can hold denormals: slow CPU math
                for t in [*model.parameters(), *model.buffers()]:
                    t.zero_()
        for name, p in model.named_parameters():
            tracker.track(p, "LoRA weights" if "lora_" in name else "base weights")
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: tracker.track(q.grad, "gradients"))
        for b in model.buffers():
            tracker.track(b, "base weights")
        with tracker:
            if d.vision is not None:
                ids, images = image_batch(cfg, d, micro, seq, model.config)
                for t in [ids, *images.values()]:  # torch.tensor on real lists: not an op
                    tracker.track(t)
            else:
                ids, images = torch.zeros((micro, seq), dtype=torch.long), {}
                if packed:
                    images = packed_rows(micro, seq)
            tracker.phase = "forward"
            loss = loss_module(input_ids=ids, labels=ids, **images)
            saved = sum(
                n for _, (n, c) in tracker.live.items() if c not in ("base weights", "LoRA weights")
            )
            tracker.phase, tracker.where = "backward", "loss"
            loss.backward()
            del loss
    return Trace(
        tokens=micro * seq,
        peak=tracker.peak,
        at_peak=tracker.at_peak,
        peak_phase=tracker.peak_phase,
        peak_where=tracker.peak_where,
        saved_after_forward=saved,
        seconds=time.perf_counter() - started,
        notes=notes,
    )


def vision_language_model(cfg: RunConfig, d: Decisions) -> Any:
    """The vision-language class of ``cfg`` (its language model and model.vision's tower), as
    rank.model loads it for images; its image tokens the last ids of the vocabulary (the trace
    writes its own rows)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from memtune.memory.counts import vision_language_type
    from memtune.rank.vision import attention_per_part

    text = dict(cfg.model.architecture)  # its own text config (mRoPE sections and all)
    vocab = int(text["vocab_size"])
    config = AutoConfig.for_model(
        vision_language_type(cfg),
        text_config=text,
        vision_config={
            "out_hidden_size": text["hidden_size"],
            **{k: v for k, v in dict(cfg.model.vision).items() if k != "model_type"},
        },
        image_token_id=vocab - 1,
        vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 3,
        video_token_id=vocab - 4,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
    )
    return AutoModelForImageTextToText.from_config(
        config, attn_implementation=attention_per_part(d.attention)
    )


def image_batch(
    cfg: RunConfig, d: Decisions, micro: int, seq: int, config: Any
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The micro batch's token ids and its planned images (memory.vision.image_load): each
    image's tokens between its start and end tokens, from each row's start, with their patches,
    grids and token types, as the rank's collator gives them.

    The ids, token types and grids are made by ``torch.tensor`` from Python lists: inside a
    FakeTensorMode that makes them constants (:func:`_known_values`)."""
    from memtune.memory.vision import image_load, tower_config

    load = image_load(cfg, d)
    if load is None:
        return torch.zeros((micro, seq), dtype=torch.long), {}
    t = tower_config(cfg)
    p = int(t.patch_size)
    width = int(t.in_channels) * int(t.temporal_patch_size) * p**2
    ids = [[0] * seq for _ in range(micro)]
    types = [[0] * seq for _ in range(micro)]
    for r in range(micro):
        at = 0
        for _ in range(load.per_row):
            ids[r][at] = config.vision_start_token_id
            ids[r][at + 1 : at + 1 + load.tokens] = [config.image_token_id] * load.tokens
            types[r][at + 1 : at + 1 + load.tokens] = [1] * load.tokens
            ids[r][at + 1 + load.tokens] = config.vision_end_token_id
            at += load.tokens + 2
    grid = [[1, load.height // p, load.width // p]] * load.images
    pixels = torch.zeros(load.images * load.patches, width)
    return torch.tensor(ids), {
        "pixel_values": pixels,
        "image_grid_thw": torch.tensor(grid),
        "mm_token_type_ids": torch.tensor(types),
    }


@contextlib.contextmanager
def _known_values(numel: int) -> Iterator[None]:
    """A step on images reads values: the tower's per-image boundaries and patch positions,
    the features' split per image and the placeholder check (from ``image_grid_thw``), the 3-D
    rotary positions (from the ids and token types: rank.vision.rope_positions). FakeTensorMode
    keeps a tensor made by ``torch.tensor`` as a constant and carries constants through ops whose
    inputs are all constants, up to ``CONSTANT_NUMEL_LIMIT`` elements (1 by default): raised to
    the micro batch's tokens here, the ids, token types and grids and everything computed from
    them alone keep their values (computed on the CPU, the fake tensor with its shape is what
    the step holds), while every tensor that touches a weight stays a shape."""
    import torch._subclasses.fake_tensor as fake_tensor

    limit = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = max(limit, 4 * numel)  # position_ids: 4 × the tokens
    try:
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = limit


def _on_values(fn: Any, tracker: Tracker) -> Any:
    """``fn`` run on the values of its constant inputs, as plain CPU tensors, its outputs
    returned as constants: for the functions of a step on images that build tensors from
    ``torch.arange`` pieces (which a FakeTensorMode makes without values) and read them back.
    The tracker sees their new tensors as on a real step, and views of their inputs (the
    constants' storages, which the fake inputs' own storages already count) as nothing new."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    def real(t: FakeTensor) -> torch.Tensor:
        assert t.constant is not None, f"{fn.__name__} on a tensor of no known values"
        return t.constant

    def on_values(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pytree.tree_map_only(FakeTensor, real, (args, kwargs))
        inputs = {
            t.untyped_storage()._cdata
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        tracker.not_counted |= inputs
        try:
            with unset_fake_temporarily():
                out = fn(*args, **kwargs)
        finally:
            tracker.not_counted -= inputs
        return pytree.tree_map_only(
            torch.Tensor, lambda t: torch.tensor(t.tolist(), dtype=t.dtype), out
        )

    return on_values


@contextlib.contextmanager
def _computed_on_values(model: Any, tracker: Tracker) -> Iterator[None]:
    """The vision-language model's functions that read what they build (:func:`_on_values`):
    its ``get_rope_index`` (the 3-D positions, which rank.vision.rope_positions calls on each
    sample: pieces of ``arange`` and a delta read back from their ``max()``), and Qwen2.5-VL's
    windows (``get_vision_window_index``: an ``arange`` grid, its padding dropped by a boolean
    mask), in the tower's module while the step runs."""
    import sys

    vl = model.get_base_model().model
    vl.get_rope_index = _on_values(vl.get_rope_index, tracker)
    tower: Any = sys.modules[type(vl.visual).__module__]
    windows = getattr(tower, "get_vision_window_index", None)
    if windows is not None:
        tower.get_vision_window_index = _on_values(windows, tracker)
    try:
        yield
    finally:
        del vl.get_rope_index
        if windows is not None:
            tower.get_vision_window_index = windows


def planned_step(cfg: RunConfig, d: Decisions) -> int:
    """The planner's bytes for what the trace measures above the weights: its activations and
    loss (or backward temporaries) rows (memory.estimate), for the same tokens and layers."""
    from memtune.memory.estimate import DROPOUT_ROW, GIB, plan
    from memtune.memory.vision import IMAGE_ROWS

    rows = plan(cfg, d).gib()
    step = (
        "activations",
        DROPOUT_ROW,
        "loss",
        "backward temporaries",
        "DoRA weight norms",
        *IMAGE_ROWS,
    )
    return round(sum(rows.get(what, 0.0) for what in step) * GIB)


def format_trace(cfg: RunConfig, d: Decisions, t: Trace) -> str:
    planned = planned_step(cfg, d)
    parts = ", ".join(
        f"{k} {v / MIB:,.0f}" for k, v in sorted(t.at_peak.items(), key=lambda kv: -kv[1])
    )
    lines = [
        f"memtune trace: {cfg.experiment} · {cfg.model.name_or_path} · {t.tokens:,} tokens · "
        f"checkpointing {d.checkpointing.label()} · "
        f"{cfg.trainer.precision} ({t.seconds:.1f} s on fake tensors)",
        f"  peak {t.peak / MIB:,.0f} MiB in {t.peak_phase} ({t.peak_where}): {parts}",
        f"  saved for backward after the forward: {t.saved_after_forward / MIB:,.0f} MiB",
        f"  the step above the weights: traced {t.step / MIB:,.0f} MiB, planned "
        f"{planned / MIB:,.0f} MiB (the plan's step rows): {planned / t.step - 1:+.1%}",
    ]
    lines += [f"  note: {n}" for n in t.notes]
    return "\n".join(lines)
