"""The per-rank memory model of a run, before any rank starts: pure functions of the config and
the parameter counts (:mod:`memtune.memory.counts`); nothing here prints or decides.

Parameter counts come from the real architecture: the model is instantiated on the meta device
from ``model.architecture`` (the fields of its config.json) and LoRA is applied to it with peft,
so nothing is downloaded and no formula guesses which layers exist. Byte sizes per component
follow from dtypes, the ZeRO stage and the optimizer:

* base weights — bf16/fp32, or NF4 (0.5 byte + block scales) / int8 (1 byte + row scales) for
  the decoder's linear layers; ZeRO-3 shards them over the ranks, except tensors under the
  persistence threshold (norms, biases) and bitsandbytes' scales;
* LoRA weights, gradients and optimizer state — fp32 (peft keeps adapters in fp32); ZeRO-2/3
  shard gradients and optimizer state, ZeRO-3 the weights too; AdamW keeps an fp32 master copy
  plus two moments (12 bytes), 8-bit AdamW 6, CPU Adam none on the device;
* activations — what autograd saves per decoder layer for a frozen base with LoRA (norm inputs
  in fp32, attention q/k/v/output, the MLP's gate/up/act, an fp32 copy of each LoRA input plus
  the dropout mask); with activation checkpointing only each layer's input is kept, plus one
  layer's activations while it is recomputed;
* the loss — plain cross-entropy holds tokens × vocab logits in bf16 and fp32 plus the fp32
  log-softmax; the chunked loss one chunk;
* DeepSpeed's reduce/prefetch buckets, and on a GPU what lies outside torch's allocator (the
  CUDA context, library workspaces: measured, CUDA_CONTEXT_GIB);
* under expert parallelism, a rank's share of the routed experts and the exchange's buffers
  (:mod:`memtune.memory.expert_parallel`).

The activation model is checked against the bytes autograd really saves
(``tests/test_plan.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memtune.config import (
    RunConfig,
    compute_bytes,
    live_reference,
    preference_loss_kind,
    prefetch_bucket_elements,
)
from memtune.config.architecture import (
    attention_exchange_widths,
    head_dim,
    layer_types,
    linear_attention_layers,
    linear_exchange_widths,
    routed_experts,
)
from memtune.config.decisions import Decisions, first_input_needs_no_grad, keeps_dropout_copies
from memtune.config.deepspeed import gradient_bucket_bytes
from memtune.expert_stacks import (
    EXPERT_NF4_BYTES,
    dequantized_bytes_per_weight,
    expert_stack_bytes,
    experts_per_chunk,
)
from memtune.memory.attention import (
    attention_backward_bytes,
    attention_bytes,
    attention_mask_bytes,
    output_copied,
)
from memtune.memory.counts import ParamCounts, count_params, linear_mixer_bytes
from memtune.memory.dora import dora_kept_bytes, dora_transient_bytes
from memtune.memory.expert_parallel import (
    assumption,
    buffer_bytes,
    expert_parallel,
    expert_partitions,
    layer_experts,
)
from memtune.memory.loading import GIB, LoadingPeak, loading_peak
from memtune.memory.mlp import swiglu_backward_bytes, swiglu_saved_bytes
from memtune.memory.norms import norm_backward_bytes, norm_saved_bytes
from memtune.memory.router import add_balance_row
from memtune.memory.selective import adapter_outputs, keeps_matmul_output
from memtune.memory.vision import add_image_rows
from memtune.rundir import PlanRecord, PlanRow

# Outside torch's allocator (CUDA context, kernels, cuBLAS workspaces, NCCL): 1.30 GiB in memtune's
# rank at its peaks, one H200 (bench/results/2026-12-04-h200*.json); each GPU run checks its own.
CUDA_CONTEXT_GIB = 1.3
CONTEXT_ROW = "CUDA context + workspaces"
"""The plan's row for what a rank holds outside torch's allocator (CUDA_CONTEXT_GIB)."""


# Caching-allocator fragmentation on top of the peak of live tensors: reserved over allocated
# measured 3-4% at 2-4k tokens (H200, 2026-12-04) ...
FRAGMENTATION = 0.05
# ... and with the MLP tiled and the layer inputs offloaded, at 32-64k tokens, 2.1-4.6 GiB: 33-46%
# of what the step allocates above the weights (tiles, fp32 norm temporaries and the copy
# stream's blocks of many sizes; the same run): this share of the per-token rows, 5% of the rest.
# Measured before expandable segments were the default and before the fetched layer inputs moved
# to the compute stream's pool (rank.long_context): both should shrink it; the GPU check's long
# phases measure it again.
LONG_CONTEXT_FRAGMENTATION = 0.45

NF4_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}  # by double_quant


@dataclass
class Plan:
    rows: list[PlanRow] = field(default_factory=list)
    """GiB per rank, each row with what a measurement can see of it (allocated / live /
    per_token), said where the row is added."""
    device_gib: float | None = None
    counts: ParamCounts | None = None
    host_rows: list[PlanRow] = field(default_factory=list)  # pinned, per rank
    host_gib: float | None = None  # what the ranks of a node may pin, per rank
    loading: LoadingPeak | None = None
    """A quantized mixture's start-up: what a rank holds while its base is read and its expert
    stacks quantized (:func:`loading_peak`); None where loading holds no more than the base."""
    loading_host_budget_gib: float | None = None
    """Host memory a rank may hold while loading: plan.host_gib over a node's ranks (they all
    load at once), or this machine's for CPU ranks (:func:`host_budget_gib`); None: unchecked."""

    @property
    def host_total_gib(self) -> float:
        return sum(r.gib for r in self.host_rows)

    @property
    def total_gib(self) -> float:
        return sum(r.gib for r in self.rows)

    def gib(self) -> dict[str, float]:
        """``{what: GiB per rank}`` of the rows."""
        return {r.what: r.gib for r in self.rows}

    @property
    def device_fits(self) -> bool:
        """The step's peak and the loading peak within the device (where it is known)."""
        step = self.device_gib is None or self.total_gib <= self.device_gib
        return step and self.loading_fits_device

    @property
    def loading_fits_device(self) -> bool:
        """The loading peak within the device (where both are known)."""
        lo, device = self.loading, self.device_gib
        return lo is None or device is None or lo.device_gib <= device

    @property
    def fits(self) -> bool:
        """The device, the pinned host rows and the loading's host memory, each where known."""
        return (
            self.device_fits
            and (self.host_gib is None or self.host_total_gib <= self.host_gib)
            and self.loading_fits_host
        )

    @property
    def loading_fits_host(self) -> bool:
        """The loading peak's host memory within :attr:`loading_host_budget_gib` (where both
        are known): every rank of a node reads its base at once."""
        budget = self.loading_host_budget_gib
        return self.loading is None or budget is None or self.loading.host_gib <= budget

    def add(self, what: str, nbytes: float, how: str, **kind: bool) -> None:
        self.rows.append(PlanRow(what, nbytes / GIB, how, **kind))

    def record(self) -> PlanRecord:
        """``plan.json``: the rows as numbers, each with what it is, for the ranks to compare
        their peaks with at the end."""
        return PlanRecord(
            rows=list(self.rows),
            total_gib=self.total_gib,
            device_gib=self.device_gib,
            host_rows=list(self.host_rows),
            host_gib=self.host_gib or 0.0,
            loading_device_gib=None if self.loading is None else self.loading.device_gib,
            loading_host_gib=None if self.loading is None else self.loading.host_gib,
        )


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
QKV = ("q_proj", "k_proj", "v_proj")


def layer_bytes(
    cfg: RunConfig,
    d: Decisions,
    tokens: int,
    counts: ParamCounts,
    cuda: bool = True,
    kind: str = "attention",
) -> int:
    """What autograd keeps for one decoder layer's backward, for ``tokens`` tokens (a rank's
    share when the sequence is split: everything but attention is token-wise, and Ulysses
    attention holds the whole sequence for heads / sp of the heads — the same bytes).
    ``kind``: ``"linear_attention"`` for a hybrid's Gated DeltaNet layers (Qwen3.5), whose token
    mixer is measured (memory.counts.linear_mixer_bytes); any other kind is an attention
    layer."""
    a = cfg.model.architecture
    h, inter = int(a["hidden_size"]), int(a.get("intermediate_size") or 0)
    b = compute_bytes(cfg)
    n = tokens
    norms = 2 * norm_saved_bytes(d, n, h, b)  # the layer's two RMSNorms
    if kind == "linear_attention":
        mixer = linear_mixer_bytes(cfg, n)
        inputs = counts.linear_attention_lora_inputs
    else:
        mixer, extra = attention_bytes(cfg, d, n)
        norms += extra
        inputs = counts.lora_inputs
    if routed_experts(dict(a)):
        # a mixture's block: router, routed experts, shared expert (its adapters are in inputs)
        mlp = moe_block_bytes(cfg, d, n)
    elif d.tiled_mlp:
        # Only the MLP's input; its intermediates and its LoRA's inputs live one tile at a
        # time, inside the backward's recompute (rank/long_context.py).
        mlp = n * h * b
        inputs = [i for i in inputs if i[0] not in MLP_PROJECTIONS]
    else:
        mlp = swiglu_saved_bytes(d, n, inter, b)
    copies = keeps_dropout_copies(cfg, d)
    lora = lora_activation_bytes(inputs, n, b, copies, cuda)
    lora += dora_kept_bytes(cfg, d, inputs, counts, n)
    if kind != "linear_attention" and not copies and output_copied(cfg, d):
        lora += sum(n * i * b for name, i, _ in inputs if name == "o_proj")
    return norms + mixer + mlp + lora


def attention_half_bytes(
    cfg: RunConfig, d: Decisions, tokens: int, counts: ParamCounts, cuda: bool = True
) -> int:
    """What an attention layer still holds when its attention's backward runs: its MLP half
    and o_proj have run theirs, so the first norm's, attention's and q/k/v's adapters' saved
    tensors are left (:func:`layer_bytes`' parts)."""
    h, b = int(cfg.model.architecture["hidden_size"]), compute_bytes(cfg)
    mixer, extra = attention_bytes(cfg, d, tokens)
    qkv = [i for i in counts.lora_inputs if i[0] in QKV]
    lora = lora_activation_bytes(qkv, tokens, b, keeps_dropout_copies(cfg, d), cuda)
    lora += dora_kept_bytes(cfg, d, qkv, counts, tokens)
    return norm_saved_bytes(d, tokens, h, b) + mixer + extra + lora


def moe_block_bytes(cfg: RunConfig, d: Decisions, n: int) -> int:
    """What a mixture-of-experts block keeps for backward over ``n`` tokens, without its
    shared expert's adapters (lora_inputs has them). rank.experts runs each expert on the
    tokens routed to it, n × num_experts_per_tok rows over all experts whatever the balance:
    per row its gate/up output (2 × moe_intermediate, the SiLU keeps the fused tensor), the
    SiLU's output, the expert output before and after the routing weight (hidden each), and
    with adapted experts the row's input (hidden) and the product (moe_intermediate) their A
    matrices read plus both adapters' r-wide middles. The router keeps its fp32 probabilities
    over all experts and the top-k picks; a shared expert (Qwen3.5-MoE) keeps a dense MLP's three
    intermediate-wide tensors, its sigmoid gate and the output that gate multiplies."""
    a = cfg.model.architecture
    h, b = int(a["hidden_size"]), compute_bytes(cfg)
    experts, top = routed_experts(dict(a)), int(a["num_experts_per_tok"])
    inter = int(a["moe_intermediate_size"])
    # + the routing weight and the row's token index; the weighted output twice (the product
    # keeps its input, the index_add_ that sums the rows per token keeps its source)
    row = (3 * inter + 2 * h) * b + 4 + 8
    if d.experts is not None and d.experts.adapted:
        row += (h + inter + 2 * cfg.peft.r) * b
    router = n * experts * 4 + n * top * (8 + 4) + n * 4
    shared = int(a.get("shared_expert_intermediate_size") or 0)
    shared_bytes = n * (3 * shared + h + 1) * b if shared else 0
    return n * top * row + router + shared_bytes


def kept_inputs(d: Decisions) -> int:
    """Checkpointed layer inputs on the device: all of them, or with offloaded activations
    the one being recomputed and the one fetched ahead (rank/long_context.py)."""
    k = d.checkpointing.recomputed
    return min(k, 2) if d.offload_activations else k


def layer_kinds(cfg: RunConfig) -> list[str]:
    """Each decoder layer as layer_bytes plans it: "linear_attention" or "attention"."""
    return [
        "linear_attention" if kind == "linear_attention" else "attention"
        for kind in layer_types(dict(cfg.model.architecture))
    ]


def _by_kind(
    cfg: RunConfig, d: Decisions, tokens: int, counts: ParamCounts, cuda: bool, kinds: list[str]
) -> dict[str, int]:
    return {kind: layer_bytes(cfg, d, tokens, counts, cuda, kind) for kind in set(kinds)}


def selective_kept(cfg: RunConfig, tokens: int, counts: ParamCounts) -> tuple[int, int]:
    """(what a selective layer keeps from its forward to its backward, the part of it a
    recomputed layer's activations share) for ``tokens`` tokens (rank.layers: torch's
    selective checkpointing keeping the base matmuls' and attention's outputs). Kept: the layer's
    input, every linear layer's output (q, k, v, o, gate, up, down), each adapter's A output
    (and its B output where :func:`keeps_matmul_output` keeps it), attention's output and its
    fp32 logsumexp. Shared with what the backward's recompute saves: attention's output and
    logsumexp, the gate and up outputs the MLP's backward reads, the adapters' A outputs
    (lora_B's input). Dense attention layers only (config.validate: not built for linear
    attention or routed experts)."""
    a = cfg.model.architecture
    n, b, h = tokens, compute_bytes(cfg), int(a["hidden_size"])
    heads, inter = int(a["num_attention_heads"]), int(a.get("intermediate_size") or 0)
    shapes = {name.split(".")[-1]: (i, o) for name, i, o in counts.linear_shapes}
    base = sum(o for i, o in shapes.values() if keeps_matmul_output(i, o))
    attention = n * heads * head_dim(a) * b + n * heads * 4
    adapters = sum(
        n * (r + (out if kept else 0)) * b for _, r, out, kept in adapter_outputs(counts)
    )
    kept = n * h * b + n * base * b + adapters + attention
    shared = attention + 2 * n * inter * b + sum(n * r * b for _, _, r in counts.lora_inputs)
    return kept, shared


FIRST_NORM_READERS = (*QKV, "in_proj_qkv", "in_proj_z")
"""Adapters that read a layer's first norm: q, k, v, or a linear-attention layer's inputs."""
FIRST_NORM_LINEARS = (*FIRST_NORM_READERS, "in_proj_a", "in_proj_b")
"""The linear layers that read it (a linear-attention layer's a and b are never adapted)."""


def saved_bytes(
    cfg: RunConfig, d: Decisions, tokens: int, counts: ParamCounts, cuda: bool = True
) -> int:
    """What autograd keeps when the forward ends: the input of each layer recomputed in full
    (the first ones), what each selective layer keeps (the next ones), everything of the
    others, and the final norm's input."""
    h = int(cfg.model.architecture["hidden_size"])
    n, b = tokens, compute_bytes(cfg)
    kinds = layer_kinds(cfg)
    k, s = d.checkpointing.recomputed, d.checkpointing.selective
    each = _by_kind(cfg, d, tokens, counts, cuda, kinds[k + s :])
    kept = kept_inputs(d) * n * h * b + sum(each[kind] for kind in kinds[k + s :])
    if s:
        kept += s * selective_kept(cfg, tokens, counts)[0]
    if first_input_needs_no_grad(d):
        # The frozen embedding's output needs no gradient, so the first norm keeps nothing,
        # nor do the dropouts of the first layer's adapters that read it keep their masks
        # (only their dropped copies).
        kept -= norm_saved_bytes(d, n, h, b)
        if keeps_dropout_copies(cfg, d):
            mask = 1 if cuda else b
            first = (
                counts.linear_attention_lora_inputs
                if kinds[0] == "linear_attention"
                else counts.lora_inputs
            )
            kept -= sum(n * i * mask for name, i, _ in first if name in FIRST_NORM_READERS)
    return kept + norm_saved_bytes(d, n, h, b)  # + the final norm's


def activation_bytes(
    cfg: RunConfig, d: Decisions, tokens: int, counts: ParamCounts, cuda: bool = True
) -> int:
    """The most activations alive at once for one micro batch of ``tokens`` tokens, with the
    decided (first) decoder layers recomputing their forward, in full or selectively.

    Backward reaches the checkpointed (first) layers last, after the other layers' activations
    are freed, so one recomputed layer never adds to them: the most is the checkpointed inputs
    plus the larger of the other layers' activations and one recomputed layer (the largest, in
    a hybrid). A selective layer's backward holds what it kept and its recomputed activations
    (less what they share), next to what the earlier selective layers keep.
    """
    kinds = layer_kinds(cfg)
    k, s = d.checkpointing.recomputed, d.checkpointing.selective
    saved = saved_bytes(cfg, d, tokens, counts, cuda)
    if k == 0 and s == 0:
        return saved
    each = _by_kind(cfg, d, tokens, counts, cuda, kinds)
    others = sum(each[kind] for kind in kinds[k + s :])
    moments = [saved]
    if s:
        shared = selective_kept(cfg, tokens, counts)[1]
        last = kinds[k + s - 1]
        moments.append(saved - others + each[last] - shared)
    if k:
        selective = s * selective_kept(cfg, tokens, counts)[0] if s else 0
        moments.append(saved - others - selective + max(each[kind] for kind in kinds[:k]))
    return max(moments)


def backward_bytes(
    cfg: RunConfig, d: Decisions, tokens: int, counts: ParamCounts, cuda: bool = True
) -> int:
    """What a decoder layer's backward adds, at its largest, to the activations it reads.

    The MLP's backward holds three tokens × intermediate gradients at once (of the down
    projection's input, and of the gate and up outputs; memory.mlp, by kernel) plus the
    hidden-state gradient; by
    then the down projection's backward has freed what its LoRA kept (its input). At the start
    of the layer's backward only the incoming and residual hidden gradients are new.
    (tools.step_trace measures these moments on the full-size model.)
    """
    a = cfg.model.architecture
    n, b = tokens, compute_bytes(cfg)
    h, inter = int(a["hidden_size"]), int(a.get("intermediate_size") or 0)
    if routed_experts(dict(a)):
        # The shared expert's MLP backward (a dense one's, at its width); each routed expert's
        # is over its own few rows. Over quantized stacks the grouped forward's backward holds
        # a chunk of experts being dequantized (rank.experts) beside the hidden gradients: its
        # weights at what dequantizing holds a weight (int8: an fp32 copy and the result).
        inter = int(a.get("shared_expert_intermediate_size") or 0)
        chunk = 0
        if d.experts is not None and d.experts.storage != "compute":  # gate_up, the larger
            out = 2 * int(a["moe_intermediate_size"])
            per_weight = dequantized_bytes_per_weight(d.experts.storage, b)
            chunk = experts_per_chunk(out, h, b) * out * h * per_weight
        return max(2 * n * h * b + chunk, 3 * n * inter * b + n * h * b)
    if d.tiled_mlp:
        # One tile (hidden_size tokens) recomputed with autograd and backpropagated: its
        # saved intermediates and their gradients, next to the whole input's gradient.
        tile = min(n, h)
        in_tile = swiglu_saved_bytes(d, tile, inter, b) + swiglu_backward_bytes(d, tile, inter, b)
        return max(2 * n * h * b, in_tile + 2 * n * h * b)
    freed = 0
    if any(name == "down_proj" for name, _, _ in counts.lora_inputs):
        # With the masks regenerated (rank.lora_dropout) the down projection's adapter holds,
        # in its own backward, the mask and one input-sized tensor at a time (the dropped copy,
        # then the input's gradient): less than the moment after it, counted here (step_trace
        # at 32k tokens: 2.34 GB against this moment's 2.72).
        mask = 1 if cuda else b
        dropped = keeps_dropout_copies(cfg, d)
        freed = n * inter * (b + mask) if dropped else n * inter * b
    return max(2 * n * h * b, swiglu_backward_bytes(d, n, inter, b) + n * h * b - freed)


FLASH_WHAT = "FlashAttention-2's backward (dQ, its fp32 accumulator, dK and dV) + hidden gradients"
NORM_WHAT = "an RMSNorm's backward"


@dataclass
class StepPeak:
    """The moment of a training step that holds the most above the weights, and its parts."""

    where: str
    activations: int
    loss: int = 0
    backward: int = 0
    dora: int = 0  # DoRA's weight-norm temporaries in a layer's forward (or recompute)
    what: str = "MLP gradients + hidden gradient"  # what ``backward`` is, for the plan's row

    @property
    def total(self) -> int:
        return self.activations + self.loss + self.backward + self.dora


def step_peak(
    cfg: RunConfig, d: Decisions, tokens: int, counts: ParamCounts, cuda: bool = True
) -> StepPeak:
    """The largest of the step's moments (tools.step_trace measures each on the full-size
    model): the loss (all saved activations + its buffers); the final norm's backward; the
    backward of the last layer where it keeps its activations (what is saved, less what the
    final norm's backward has freed, + one layer's backward temporaries), and of its attention;
    the backward of the last selective and of the last fully recomputed layer (the checkpointed
    inputs + its recomputed activations + its backward temporaries), with their attention's,
    their second norm's under a tiled MLP and DoRA's recompute."""
    layers = int(cfg.model.architecture["num_hidden_layers"])
    k, s = d.checkpointing.recomputed, d.checkpointing.selective
    h = int(cfg.model.architecture["hidden_size"])
    saved = saved_bytes(cfg, d, tokens, counts, cuda)
    back = backward_bytes(cfg, d, tokens, counts, cuda)
    moments = [StepPeak("the loss", saved, loss=round(loss_bytes(cfg, d, tokens)))]
    attention_back = attention_backward_bytes(cfg, d, tokens, cuda)
    hidden = tokens * h * compute_bytes(cfg)
    last_kind = layer_kinds(cfg)[-1]
    # The final norm's backward, next to everything saved (tools.step_trace).
    norm_backward = norm_backward_bytes(d, tokens, h, compute_bytes(cfg))
    moments.append(
        StepPeak("backward of the final norm", saved, backward=norm_backward, what=NORM_WHAT)
    )
    # What is saved but the final norm's: before it runs (the last layer's forward), and once
    # its backward has freed it (the last layer's output: tools.step_trace's census at 32k)
    ran = saved - norm_saved_bytes(d, tokens, h, compute_bytes(cfg))
    if k + s < layers:
        moments.append(StepPeak(f"backward of layer {layers - 1}", ran, backward=back))
        if attention_back and last_kind == "attention":
            # Its attention's backward, the MLP half freed: the residual stream's gradient and
            # the attention output's beside the kernel's own (memory.attention)
            half = attention_half_bytes(cfg, d, tokens, counts, cuda)
            held = ran - layer_bytes(cfg, d, tokens, counts, cuda, last_kind) + half
            where = f"backward of layer {layers - 1}'s attention"
            moments.append(StepPeak(where, held, 0, 2 * hidden + attention_back, what=FLASH_WHAT))
    # a lean (or Liger's) first norm keeps the layer's input: the checkpoint's, counted
    shared_input = 0 if d.kernels.rms_norm == "torch" else tokens * h * compute_bytes(cfg)
    if s > 0:
        # The last selective layer's backward: the layers after it are freed; it holds what it
        # kept and its recomputed activations (less what they share: the outputs it kept, and
        # its input, which it kept too), the earlier selective layers what they keep, the
        # full ones their inputs.
        kept, shared = selective_kept(cfg, tokens, counts)
        last = layer_bytes(cfg, d, tokens, counts, cuda, layer_kinds(cfg)[k + s - 1])
        last -= shared_input
        held = kept_inputs(d) * tokens * h * compute_bytes(cfg) + s * kept - shared + last
        where = f"backward of layer {k + s - 1} (recomputed selectively)"
        moments.append(StepPeak(where, held, 0, back))
    if k > 0:
        inputs = kept_inputs(d) * tokens * h * compute_bytes(cfg)
        for kind in set(layer_kinds(cfg)[:k]):
            layer = layer_bytes(cfg, d, tokens, counts, cuda, kind) - shared_input
            where = f"backward of layer {k - 1} (recomputed)"
            moments.append(StepPeak(where, inputs + layer, 0, back))
            if d.tiled_mlp:
                # With the MLP tiled its backward is small, and the layer's peak is its second
                # norm's fp32 backward, the attention half still saved: what the allocator held
                # at a 49k-token step's peak on an H200 (bench/results/2026-12-04-h200-long.md)
                where = f"backward of layer {k - 1}'s second norm (recomputed, MLP tiled)"
                moments.append(StepPeak(where, inputs + layer, 0, norm_backward, what=NORM_WHAT))
            if attention_back and kind == "attention":
                # Its attention's backward: the residual stream's gradient and the attention
                # output's, and where a checkpoint function runs the layer's backward itself
                # (rank.long_context's, or reentrant), the layer's incoming gradient and, but
                # for the offloaded one, which frees it, the recomputed output
                half = attention_half_bytes(cfg, d, tokens, counts, cuda) - shared_input
                where = f"backward of layer {k - 1}'s attention (recomputed)"
                own = d.offload_activations or cfg.trainer.compile or d.checkpointing.reentrant
                output = own and not d.offload_activations
                back_attention = (2 + own + output) * hidden + attention_back
                moments.append(StepPeak(where, inputs + half, 0, back_attention, what=FLASH_WHAT))
            if dora := dora_transient_bytes(cfg, d, counts, tokens, kind):
                # At the end of the recompute, the moment the plain step peaks at too (the
                # backward allowance stands for what it holds there beyond the saved bytes).
                where = f"recompute of layer {k - 1} (DoRA)"
                moments.append(StepPeak(where, inputs + layer, 0, back, dora))
    last_keeps = k + s < layers
    last_kind = layer_kinds(cfg)[-1]
    if last_keeps and (dora := dora_transient_bytes(cfg, d, counts, tokens, last_kind)):
        moments.append(StepPeak(f"forward of layer {layers - 1} (DoRA)", ran, dora=dora))
    return max(moments, key=lambda m: m.total)


# What each adapted linear layer reads: q/k/v one normed hidden state, gate/up another;
# o_proj reads the attention output, which attention itself keeps (flash and SDPA kernels
# write it token-major, so the reshape before o_proj is a view of the same storage).
SHARED_INPUT = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "in_proj_qkv": "linear attn",
    "in_proj_z": "linear attn",
    "o_proj": "attention output",
    "gate_proj": "mlp",
    "up_proj": "mlp",
}


def lora_activation_bytes(
    inputs: list[tuple[str, int, int]], n: int, b: int, dropout: bool, cuda: bool
) -> int:
    """What LoRA adds to one layer's saved activations for ``n`` tokens, adapters in the
    compute dtype (``b`` bytes; model.cast_adapters).

    lora_B keeps lora_A's output (n × r). lora_A keeps its input: with dropout, each adapter's
    own dropped copy plus the mask (a bool on CUDA, the input dtype on CPU); without, the layer's
    input itself, counted once per tensor read (q/k/v share one, gate/up another).
    """
    total = sum(n * r * b for _, _, r in inputs)
    if dropout:
        mask = 1 if cuda else b
        return total + sum(n * i * (b + mask) for _, i, _ in inputs)
    read = {SHARED_INPUT.get(name, name): i for name, i, _ in inputs}
    read.pop("attention output", None)  # already counted with attention
    return total + sum(n * i * b for i in read.values())


def loss_bytes(cfg: RunConfig, d: Decisions, tokens: int) -> float:
    a = cfg.model.architecture
    vocab, h = int(a["vocab_size"]), int(a["hidden_size"])
    b = compute_bytes(cfg)
    if d.loss == "plain":
        # Forward: logits (b) + their fp32 copy + the fp32 log-softmax, for every token. Its
        # backward holds more: the saved fp32 log-softmax, its gradient and the fp32 logits'
        # gradient, 12 bytes a logit in either precision (tools.step_trace).
        return tokens * vocab * 12
    chunk = min(tokens, cfg.trainer.loss_chunk_tokens)
    return chunk * vocab * (4 + b) + 2 * tokens * h * b  # one chunk + hidden and its gradient


def live_reference_bytes(cfg: RunConfig, tokens: int) -> float:
    """preference.reference=live: the reference's forward without grad runs while the policy's
    activations are held, so the step's peak grows by what one layer of it holds at once (its
    MLP's three intermediate-wide tensors) and its last hidden states. An estimate from the
    architecture, not yet checked against a traced step (tools.step_trace traces SFT's)."""
    a = cfg.model.architecture
    h, inter = int(a["hidden_size"]), int(a.get("intermediate_size") or 0)
    if routed_experts(dict(a)):  # the routed rows' and the shared expert's intermediates
        inter = int(a["num_experts_per_tok"]) * int(a["moe_intermediate_size"])
        inter += int(a.get("shared_expert_intermediate_size") or 0)
    return tokens * (3 * inter + 2 * h) * compute_bytes(cfg)


INT8_WHOLE_WHY = "bitsandbytes keeps them in its layer state, which ZeRO-3 does not shard"
"""Why the plan counts LLM.int8's linear weights whole on every ZeRO-3 rank."""


def int8_linears_whole_bytes(counts: ParamCounts, shard: int) -> int:
    """The int8 linear weights a ZeRO-3 rank (``shard`` > 1) holds whole beside its shard of
    them; 0 unsharded, where the parameter is the whole weight.

    bitsandbytes' ``Int8Params`` keeps the quantized weight twice over, as ``.data`` and as
    ``.CB``; ZeRO-3 partitions and frees only ``.data``, and ``Linear8bitLt``'s first forward
    moves ``.CB`` into its ``MatmulLtState`` (``state.CB``), which every later forward and
    backward computes from and which lives as long as the layer. So each rank keeps every
    8-bit linear's 1 byte a weight in full plus its shard of the parameter (measured on 2 CPU
    ranks: tests/rank_probe.py, tests/test_plan.py). A mixture's int8 expert stacks are
    memtune's own parameters (rank.experts), sharded as planned."""
    return counts.linear if shard > 1 else 0


def base_weight_bytes(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, shard: int
) -> tuple[float, str]:
    """The base's bytes on a rank whose sharded weights are 1/``shard`` of them (ZeRO-3's
    ranks; 1: the whole base), and how they are stored."""
    p, t, b = cfg.peft, cfg.trainer, compute_bytes(cfg)
    other = counts.embedding + counts.head
    # a rank holds 1/ep of each routed-expert stack; sharded (ZeRO-3), over the ranks / ep
    # holding the same experts: 1/shard of them, as of the rest
    ep = 1 if shard > 1 else expert_parallel(d)
    if d.peft_method == "qlora":
        per = NF4_BYTES[p.double_quant]
        packed = counts.linear * 0.5
        scales = counts.linear * (per - 0.5)
        # a mixture's stacks: packed bytes and scales in one parameter ZeRO-3 shards
        experts = expert_stack_bytes(p.quant_type, counts.experts, counts.expert_rows) / ep
        weights = (packed + experts + other * b) / shard + scales + counts.small * b
        how = f"NF4 {counts.linear / 1e9:.2f}B linear weights + {other / 1e9:.2f}B embedding/head"
        if counts.experts:
            how += f" + {counts.experts / 1e9:.2f}B routed experts (NF4, fp32 block scales)"
    elif d.peft_method == "lora-int8":
        # a mixture's stacks: int8 bytes and row scales in one parameter ZeRO-3 shards
        experts = expert_stack_bytes("int8", counts.experts, counts.expert_rows) / ep
        weights = (
            (counts.linear + experts + other * b) / shard
            + int8_linears_whole_bytes(counts, shard)
            + counts.linear_rows * 4
            + counts.small * b
        )
        how = f"int8 {counts.linear / 1e9:.2f}B linear weights + {other / 1e9:.2f}B embedding/head"
        if shard > 1:
            how += f" (the int8 linear weights also whole on each rank: {INT8_WHOLE_WHY})"
        if counts.experts:
            how += f" + {counts.experts / 1e9:.2f}B routed experts (int8, fp32 row scales)"
    else:
        weights = (counts.linear + counts.experts / ep + other) * b / shard + counts.small * b
        how = f"{_count(counts.base)} parameters in {t.precision}"
        if counts.experts:
            how += f" ({_count(counts.experts)} of them routed experts)"
    if expert_parallel(d) > 1:
        n = expert_parallel(d)
        how += f", 1/{n} of the routed experts on this rank (trainer.expert_parallel={n})"
    return weights, how


def plan(cfg: RunConfig, d: Decisions, counts: ParamCounts | None = None) -> Plan:
    """The per-rank breakdown of ``cfg`` run as decided (``d``; see the module docstring)."""
    counts = counts or count_params(cfg)
    t = cfg.trainer
    ranks = d.batch.ranks
    b = compute_bytes(cfg)
    zero3 = d.zero_stage == 3
    shard = ranks if zero3 else 1
    out = Plan(device_gib=cfg.plan.device_gib, counts=counts)

    weights, how = base_weight_bytes(cfg, d, counts, shard)
    out.add("base weights", weights, how + (f", sharded over {ranks} ranks" if zero3 else ""))
    if d.vision is not None:
        out.add(
            VISION_WEIGHTS_ROW,
            counts.vision * b / shard,
            f"{_count(counts.vision)} tower + merger parameters in {t.precision} (never "
            "quantized)" + (f", sharded over {ranks} ranks" if zero3 else ""),
        )
    whole = base_weight_bytes(cfg, d, counts, 1)[0] if zero3 else weights
    out.loading = loading_peak(cfg, d, counts, whole, weights)
    if out.loading is not None:
        out.loading_host_budget_gib = host_budget_gib(cfg)

    # In the compute dtype on every stage (model.cast_adapters); the fp32 copy is the
    # optimizer's master weights, counted below.
    ep = expert_parallel(d)
    lora = counts.lora - counts.expert_lora * (1 - 1 / ep)  # this rank's experts' adapters
    # (ZeRO-3: the experts' share over the ranks / ep holding them, 1/ranks as the rest)
    held = counts.lora / ranks if zero3 else lora
    shared = f", sharded over {ranks} (ZeRO-3)" if zero3 else ""
    out.add("LoRA weights", held * b, f"{_count(round(lora))} {t.precision}{shared}")
    # under expert parallelism, the experts' 1/ep sharded over the ranks/ep holding them (the
    # expert-data-parallel group): 1/ranks of them as well (memory.expert_parallel)
    group = ranks // ep
    over = f"{ranks} (ZeRO)"
    if ep > 1:
        over = f"{ranks} (ZeRO; the experts' over the {group} ranks holding them)"
    if ep > 1 and group == 1:
        over = f"{ranks} (ZeRO; the experts' each whole on its one rank)"
    out.add("LoRA gradients", counts.lora * 4 / ranks, f"fp32, sharded over {over}")
    state = {"adamw": 12, "adamw_8bit": 6, "cpu_adam": 0}[d.optimizer]
    out.add(
        "optimizer state",
        counts.lora * state / ranks,
        {
            "adamw": "fp32 master + 2 moments",
            "adamw_8bit": "fp32 master + 8-bit moments",
            "cpu_adam": "on the host (offload)",
        }[d.optimizer],
    )

    out.add("DeepSpeed buckets", *gradient_bucket_bytes(cfg, d, counts.largest_lora_tensor(ep)))
    if zero3:
        # Whole tensors gathered while in use: the largest of one decoder layer, the embedding
        # and the head (gathered once for the loss), plus what is prefetched meanwhile.
        # (under expert parallelism a layer's experts are its group's 1/ep, gathered over
        # the ranks holding them: none where they are whole on one rank)
        gone = 1 - (1 / ep if expert_partitions(d) > 1 else 0) if ep > 1 else 0
        layer = counts.layer - layer_experts(cfg, counts.experts) * gone
        largest = max(layer, counts.embedding, counts.head)
        prefetch = prefetch_bucket_elements(cfg)
        per_weight = {
            "qlora": EXPERT_NF4_BYTES if counts.experts else 0.5,
            "lora-int8": 1 if counts.experts else b,  # the int8 stacks fill a mixture's layer
        }.get(d.peft_method, b)
        gathered = (largest + prefetch) * per_weight
        if d.peft_method == "qlora" and largest != layer:
            gathered = largest * b + prefetch * 0.5
        out.add("ZeRO-3 gathered params", gathered, "largest module in use + prefetch")

    tokens, sp = d.batch.rank_tokens, d.sequence_parallel
    cuda = cfg.plan.device_gib is not None
    k = d.checkpointing.recomputed
    peak = step_peak(cfg, d, tokens, counts, cuda)
    label = d.checkpointing.label()
    ckpt = "no checkpointing" if label == "off" else f"{label} checkpointed"
    extras = [f"{ckpt}"]
    if d.tiled_mlp:
        extras.append("MLP tiled")
    if d.offload_activations and k:
        extras.append("checkpointed inputs on the host")
    share = f" (1/{sp} of each sequence)" if sp > 1 else ""
    linear = linear_attention_layers(cfg.model.architecture)
    if linear:
        extras.append(f"{linear} linear-attention layers as measured on transformers' torch code")
    if cfg.peft.dropout > 0 and not keeps_dropout_copies(cfg, d):
        extras.append("LoRA dropout's masks regenerated in backward (no copies kept)")
    if d.kernels.rms_norm != "torch":
        extras.append(
            f"{'lean' if d.kernels.rms_norm == 'lean' else 'Liger'} RMSNorm (no fp32 copies)"
        )
    if d.kernels.swiglu != "torch":
        extras.append(
            f"{'lean' if d.kernels.swiglu == 'lean' else 'Liger'} SwiGLU (SiLU's output not kept)"
        )
    copies = dropout_copies_bytes(cfg, d, tokens, counts, cuda, peak)
    out.add(
        "activations",
        peak.activations - copies,
        f"{tokens:,} tokens per micro batch{share}, {', '.join(extras)}",
        per_token=True,
    )
    if copies:
        out.add(
            DROPOUT_ROW,
            copies,
            f"peft.dropout={cfg.peft.dropout:g}: each adapted module's input copied with its "
            f"mask ({'1 byte' if cuda else 'the compute dtype'} a value), kept for backward "
            "where the input itself would be shared; peft.dropout=0 keeps none",
            per_token=True,
        )
    add_balance_row(out.add, cfg, tokens)
    add_image_rows(out.add, cfg, d, cuda)
    if peak.dora:
        out.add(
            "DoRA weight norms",
            peak.dora,
            "peft's DoRA builds B·A as a weight through an identity matrix (in × in) for the "
            "row norms, in every forward and recompute; its largest module's "
            f"(the step's peak: {peak.where})",
        )
    if peak.loss:
        how = f"{d.loss} cross-entropy (the step's peak: in the loss)"
        if t.objective != "sft":  # rank.preference: the same chunked head, per-token log-probs
            kind = preference_loss_kind(d.loss)
            how = f"{kind} log-probabilities of the replies, {t.objective} (the step's peak)"
        out.add("loss", peak.loss, how, per_token=True)
    elif peak.backward or not peak.dora:
        out.add(
            "backward temporaries",
            peak.backward,
            f"{peak.what} (the step's peak: {peak.where})",
            per_token=True,
        )
    if live_reference(cfg):
        out.add(
            "live reference forward",
            live_reference_bytes(cfg, tokens),
            "one layer of the reference's no-grad forward + its hidden states, next to the "
            "policy's activations (an estimate from the architecture; precomputed needs none)",
            per_token=True,
        )
    if sp > 1:
        buffers, what = ulysses_buffer_bytes(cfg, d, tokens), "q, k, v"
        if linear and linear_exchange_bytes(cfg, tokens) > buffers:
            buffers = linear_exchange_bytes(cfg, tokens)
            what = "a linear-attention layer's q, k, v, z, a, b"
        out.add(
            "sequence-parallel buffers",
            buffers,
            f"all-to-all in/out of {what} over {sp} ranks (Ulysses; one layer at a time)",
            per_token=True,
        )
    if ep > 1:
        out.add(EXPERT_BUFFERS_ROW, buffer_bytes(cfg, d), assumption(cfg, d), per_token=True)
    if d.offload_activations and k:
        h = int(cfg.model.architecture["hidden_size"])
        out.host_rows.append(
            PlanRow(
                "offloaded layer inputs",
                k * tokens * h * compute_bytes(cfg) / GIB,
                f"{k} layers × {tokens:,} tokens × hidden, pinned",
            )
        )
        out.host_gib = host_budget_gib(cfg)
    mask = attention_mask_bytes(cfg, d)
    if mask:
        n = d.batch.row_tokens
        out.add(
            "attention mask",
            mask,
            f"dense {d.batch.micro_batch}×{n:,}×{n:,} mask of {d.attention} "
            "(model.attn_implementation=auto needs none)",
            per_token=True,
        )
    live = out.total_gib * GIB
    fragmentation, how = live * FRAGMENTATION, f"{FRAGMENTATION:.0%} of the above"
    if d.tiled_mlp or d.offload_activations:
        step = sum(r.gib for r in out.rows if r.per_token) * GIB
        fragmentation = (live - step) * FRAGMENTATION + step * LONG_CONTEXT_FRAGMENTATION
        how = (
            f"{LONG_CONTEXT_FRAGMENTATION:.0%} of the rows that grow with tokens (MLP tiled / "
            f"inputs offloaded: measured), {FRAGMENTATION:.0%} of the rest"
        )
    out.add(
        "allocator fragmentation",
        fragmentation,
        how,
        live=False,  # only the allocator's reserved pool holds it
    )
    if cfg.plan.device_gib is not None:
        # outside the allocator: max_memory_allocated / reserved never see it
        how = "measured outside the allocator (H200, 2026-12-04)"
        out.add(CONTEXT_ROW, CUDA_CONTEXT_GIB * GIB, how, allocated=False)
    return out


VISION_WEIGHTS_ROW = "vision tower weights"
EXPERT_BUFFERS_ROW = "expert-parallel buffers"
DROPOUT_ROW = "LoRA dropout copies"
"""The plan row of what LoRA dropout keeps beyond the same step without it (rank.worker names
it in the start-up line)."""


def dropout_copies_bytes(
    cfg: RunConfig, d: Decisions, tokens: int, counts: ParamCounts, cuda: bool, peak: StepPeak
) -> int:
    """What LoRA dropout adds to the step's saved activations at its peak: the activations of
    ``peak`` less those of the same step with peft.dropout=0 (each adapter's dropped copy and
    mask, where without dropout the adapters of one input share it; lora_activation_bytes).
    None when the masks are regenerated in backward (kernels.lora_dropout)."""
    if not keeps_dropout_copies(cfg, d):
        return 0
    without = dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, dropout=0.0))
    return max(0, peak.activations - step_peak(without, d, tokens, counts, cuda).activations)


def ulysses_buffer_bytes(cfg: RunConfig, d: Decisions, tokens: int) -> int:
    """The all-to-all's contiguous input and output copies of q, k and v for one layer (the
    backward's exchange of their gradients is the same size)."""
    out, _ = attention_exchange_widths(dict(cfg.model.architecture), d.sequence_parallel)
    return 2 * tokens * out * compute_bytes(cfg)


def linear_exchange_bytes(cfg: RunConfig, tokens: int) -> int:
    """A linear-attention layer's all-to-all copies under sequence parallelism
    (rank.linear_attention.Split): q, k, v, the gate z and the per-head a, b go out to the
    ranks' heads, each as a contiguous input copy and the exchanged output, in the compute
    dtype (:func:`linear_exchange_widths`; the output's exchange back is smaller: v's width
    only)."""
    out, _ = linear_exchange_widths(dict(cfg.model.architecture))
    return 2 * tokens * out * compute_bytes(cfg)


def host_budget_gib(cfg: RunConfig) -> float | None:
    """Host memory one rank may pin: plan.host_gib shared by a node's ranks; for CPU ranks
    planned on this machine without it, its available RAM; else unknown (None)."""
    per_node = max(1, cfg.launcher.num_ranks // max(1, cfg.launcher.nnodes))
    if cfg.plan.host_gib is not None:
        return cfg.plan.host_gib / per_node
    if cfg.plan.device_gib is None:
        from memtune.machine import host_available_gib

        return host_available_gib() / per_node
    return None


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"
