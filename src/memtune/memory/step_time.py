"""What an optimizer step costs in time, before any rank starts: compute and communication.

A stated model, meant to rank configurations that fit (``plan.auto_fit``, the shipped
experiments' ZeRO stage) and to say how much of a step is spent moving bytes:

* **compute** — matmul FLOPs per rank: the decoder's and the head's linear layers (2 FLOPs per
  weight per token forward, 2 more for the activation gradient in backward — a frozen base
  computes no weight gradient, and the projections reading the first layer's input (q, k, v;
  a linear-attention layer's in_proj_*) none where that input needs no gradient (no layer
  recomputed) — and 2 more in each recomputed layer), LoRA's (6 per weight
  per token, 8 when recomputed, 4 for those first projections' A where their input needs
  none, and a selective layer's B again where it does not keep B's output), and causal
  attention over whole rows (an upper bound when rows are packed with short samples) in the
  attention layers only (:func:`attention_passes`: a hybrid's
  linear-attention layers, Qwen3.5's Gated DeltaNet, have no n × n scores, and their
  recurrence is not counted). Time = FLOPs / (``plan.device_tflops`` × ``plan.mfu``); a 4-bit
  base adds its dequantization (``QLORA_COMPUTE``). ``tests/test_step_time.py`` checks the
  FLOPs against torch's own count of a real step.
* **communication** — bytes each rank sends per optimizer step in ring collectives (an
  all-gather or reduce-scatter of S bytes moves (R−1)/R·S per rank, an all-reduce twice that):
  under ZeRO-3 the sharded weights are all-gathered in every micro step's forward and again in
  its backward (a recomputed layer reuses its backward gather) and the LoRA gradients are
  reduce-scattered per micro step; under ZeRO-2 the LoRA gradients are reduce-scattered per
  micro step and the updated LoRA weights all-gathered once per step. Time = bytes / the bus
  bandwidth ``plan.link_gb_s`` (the GPU preflight measures it: ``preflight.json``).
* **memory-bound passes** — LoRA dropout reads each adapted module's input and writes its copy
  and mask in the forward (and a recompute), the backward reads the gradient and the mask and
  writes the gradient; a selective layer's recompute runs its norms, rotary, SiLU and LoRA
  adds (and an 8-bit base's input quantization) again without the matmuls that would carry
  them inside ``plan.mfu`` (:func:`selective_pass_bytes`): those bytes at
  ``plan.device_gb_s`` (the device's memory bandwidth), when it is given. The other
  elementwise work is inside ``plan.mfu``.
* **images** — the vision tower's matmuls on the micro batch's planned images
  (:func:`tower_flops`), and under ZeRO-3 its all-gathers: forward only for a frozen tower.
* **expert parallelism** — per mixture layer and micro batch, the dispatch's and the
  combine's hidden vectors and the rows' routing weights to the other ranks of the group, in
  forward, backward and every recompute, and the rows' indices in forward and recompute
  (memory.expert_parallel: uniform routing, the distinct ranks a token reaches exact); the
  experts' adapter gradients reduced over the ranks holding the same experts only.
* **no overlap** is assumed: step = compute + communication. DeepSpeed prefetches ZeRO-3
  gathers during compute, but over PCIe without P2P the copies go through host memory and
  compete with the kernels; the sum is the conservative figure. The other bound, every
  transfer hidden behind the compute (:attr:`StepTime.overlapped_s`), is printed beside it.
* **long context** — a sequence split over sp ranks (Ulysses) leaves each rank 1/sp of the
  tokens of every linear layer and 1/sp of the heads of full-sequence attention, and adds
  all-to-alls per layer (an attention layer's q, k, v in and its output back; a
  linear-attention layer's q, k, v, z, a, b in and its output back: :func:`ulysses_bytes`),
  each sending (sp−1)/sp of its tensor, in forward, backward and every recompute, over
  ``plan.link_gb_s``. A tiled MLP
  runs its forward once more (the backward's tile-by-tile recompute). Offloaded activations
  copy each checkpointed layer's input to the host and back over ``plan.host_link_gb_s`` on
  a side stream: only what the copies take beyond the step's compute is added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memtune.config import RunConfig, compute_bytes, live_reference
from memtune.config.architecture import (
    attention_exchange_widths,
    head_dim,
    linear_exchange_widths,
)
from memtune.config.decisions import Decisions, first_input_needs_no_grad
from memtune.expert_stacks import expert_stack_bytes
from memtune.memory.attention import QK_NORMED, output_concatenated
from memtune.memory.counts import ParamCounts, count_params
from memtune.memory.estimate import MLP_PROJECTIONS, NF4_BYTES, QKV
from memtune.memory.expert_parallel import expert_parallel, step_exchange_bytes
from memtune.memory.mlp import swiglu_forward_bytes
from memtune.memory.norms import norm_forward_bytes
from memtune.memory.selective import adapter_outputs

SELECTIVE_OPS = "norms, rotary, SiLU, LoRA adds"
"""What a selective layer's recompute runs again outside the matmuls
(:func:`selective_pass_bytes`), for the step estimate's row; lora-int8 adds its re-quantization."""

QLORA_COMPUTE = 1.30
"""A 4-bit base dequantizes every weight before each matmul: ~30% more compute time."""


@dataclass
class StepTime:
    flops: float  # per rank per optimizer step
    compute_s: float
    traffic: list[tuple[str, float]] = field(default_factory=list)  # (what, bytes per rank)
    link_gb_s: float | None = None
    host_bytes: float = 0.0  # offloaded activations, to the host and back, per rank
    host_link_gb_s: float = 20.0
    dropout_bytes: float = 0.0  # memory-bound passes priced apart: LoRA dropout's,
    selective_bytes: float = 0.0  # and the selective layers' recomputes (of these ops)
    selective_ops: str = SELECTIVE_OPS
    device_gb_s: float | None = None  # what they are priced at

    def _at_device_bandwidth(self, nbytes: float) -> float:
        return nbytes / (self.device_gb_s * 1e9) if self.device_gb_s else 0.0

    @property
    def dropout_s(self) -> float:
        return self._at_device_bandwidth(self.dropout_bytes)

    @property
    def selective_s(self) -> float:
        return self._at_device_bandwidth(self.selective_bytes)

    @property
    def elementwise_s(self) -> float:
        """The memory-bound passes at the device's bandwidth (0 when it is not given)."""
        return self.dropout_s + self.selective_s

    @property
    def host_s(self) -> float:
        """Copy time of offloaded activations beyond the compute they overlap."""
        return max(0.0, self.host_bytes / (self.host_link_gb_s * 1e9) - self.compute_s)

    @property
    def bytes(self) -> float:
        return sum(b for _, b in self.traffic)

    @property
    def comm_s(self) -> float:
        if not self.bytes:
            return 0.0
        if not self.link_gb_s:
            return float("inf")
        return self.bytes / (self.link_gb_s * 1e9)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.elementwise_s + self.comm_s + self.host_s

    @property
    def overlapped_s(self) -> float:
        """The step were every transfer hidden behind the compute it can run beside: the
        larger of the two (the lower bound; :attr:`step_s` is the sum)."""
        return max(self.compute_s + self.elementwise_s, self.comm_s) + self.host_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_s if self.step_s else 0.0

    @property
    def priced(self) -> bool:
        """False where the ranks exchange bytes but ``plan.link_gb_s`` is not given: the step
        is then unbounded for the choices (:attr:`step_s` is inf) and printed as its compute."""
        return bool(self.link_gb_s) or not self.bytes

    def seconds(self) -> str:
        """The step for a line: its seconds, or its compute and the unpriced exchanges."""
        if self.priced:
            return f"{self.step_s:.2f} s"
        done = self.compute_s + self.elementwise_s + self.host_s
        return f"{done:.2f} s + communication not priced (plan.link_gb_s unset)"


@dataclass(frozen=True)
class Flops:
    """Matmul FLOPs of one micro batch (forward, recompute, backward), by kind."""

    base: float  # the frozen decoder and head linear layers
    lora: float
    attention: float  # causal: half of the n × n scores, in the attention layers
    tiles: float = 0.0  # a tiled MLP's second forward (its backward's recompute)
    reference: float = 0.0  # preference.reference=live: the reference's forward in every step
    dora: float = 0.0  # peft.dora: the weight built through an identity, the dropout's base pass
    vision: float = 0.0  # the vision tower on the micro batch's images (memory.vision)

    @property
    def total(self) -> float:
        parts = (self.base, self.lora, self.attention, self.tiles, self.reference, self.dora)
        return sum(parts) + self.vision


def micro_step_flops(cfg: RunConfig, d: Decisions, counts: ParamCounts) -> Flops:
    """See the module docstring. The head multiplies every token twice (logits, and the
    gradient of the hidden state): the chunked loss computes both in its forward."""
    from memtune.memory.estimate import FIRST_NORM_LINEARS, FIRST_NORM_READERS, layer_kinds

    a = cfg.model.architecture
    layers = int(a["num_hidden_layers"])
    n, micro = d.batch.row_tokens, d.batch.micro_batch
    tokens, sp = d.batch.rank_tokens, d.sequence_parallel  # this rank's share
    k = d.checkpointing.recomputed
    head = counts.head or counts.embedding  # the LM head multiplies even when tied
    # A mixture's token multiplies only the experts it is routed to (counts.active).
    share = counts.routed_share
    per_layer = (counts.linear + counts.experts * share) / layers
    base = 2 * tokens * (per_layer * (2 * layers + k) + 2 * head)
    # An adapter's weights: 2 FLOPs per token forward, 4 backward (input and weight
    # gradients), 2 more when its layer recomputes.
    active_lora = counts.lora - counts.expert_lora * (1 - share) - counts.vision_lora
    lora = 2 * tokens * (active_lora / layers) * (3 * layers + k)
    # a selective layer multiplies again the B whose outputs it does not keep: r × out each
    remade = sum(r * out for r, out, kept in remade_adapters(counts) if not kept)
    lora += 2 * tokens * d.checkpointing.selective * remade
    if first_input_needs_no_grad(d):
        # nor does the first layer's input: the projections reading its first norm and their
        # adapters' A compute no input gradient (autograd's, checked in tests/test_step_time)
        first = layer_kinds(cfg)[0] == "linear_attention"
        prefix = "linear_attn." if first else "self_attn."
        readers = sum(
            i * o
            for name, i, o in counts.linear_shapes
            if name.startswith(prefix) and name.split(".")[-1] in FIRST_NORM_LINEARS
        )
        base -= 2 * tokens * readers
        adapters = counts.linear_attention_lora_inputs if first else counts.lora_inputs
        lora -= 2 * tokens * sum(i * r for name, i, r in adapters if name in FIRST_NORM_READERS)
    heads = int(a["num_attention_heads"])
    # QKᵀ and PV: 2 matmuls × 2 FLOPs × n²/2 (causal) per row and head, in one attention
    # layer's forward; a rank of a sequence-parallel group attends for heads / sp of the heads.
    attn_fwd = micro * 2 * n * n * heads * head_dim(a) / sp
    tiles = 0.0
    if d.tiled_mlp:
        h, inter = int(a["hidden_size"]), int(a["intermediate_size"])
        adapted = sum(1 for name, _, _ in counts.lora_inputs if name in MLP_PROJECTIONS)
        # 2 FLOPs per weight per token: the three projections, and r × (in + out) per adapter
        tiles = 2 * tokens * layers * (3 * h * inter + adapted * cfg.peft.r * (h + inter))
    reference = 0.0
    if live_reference(cfg):
        # One more forward of the base, adapter off, without grad (rank.preference).
        reference = 2 * tokens * (per_layer * layers + head) + attn_fwd * attention_layers(cfg)
    dora = dora_flops(cfg, d, counts)
    vision = tower_flops(cfg, d, counts)
    attention = attn_fwd * attention_passes(cfg, d)
    return Flops(base, lora, attention, tiles, reference, dora, vision)


def attention_layers(cfg: RunConfig) -> int:
    """The decoder layers with n × n attention scores: every layer but a hybrid's
    linear-attention ones (Qwen3.5: one in four is full attention)."""
    from memtune.memory.estimate import layer_kinds

    return sum(kind != "linear_attention" for kind in layer_kinds(cfg))


def attention_passes(cfg: RunConfig, d: Decisions) -> int:
    """One micro batch's causal attention in forwards of one layer: in each attention layer
    its forward, its backward (twice the forward's FLOPs) and, where the layer recomputes in
    full, its forward again (a selective layer keeps attention's output: rank.layers). A
    linear-attention layer (Gated DeltaNet) has no n × n scores: its projections are among
    the linear layers; its conv and chunked delta-rule recurrence, linear in tokens, are not
    counted — their matmuls depend on the kernel's chunking (transformers' torch code solves a
    triangular system per chunk, flash-linear-attention's kernels do otherwise), so there is
    no one count to check against torch's."""
    from memtune.memory.estimate import layer_kinds

    k = d.checkpointing.recomputed  # the first k layers (Checkpointing's order)
    return sum(
        3 + (index < k) for index, kind in enumerate(layer_kinds(cfg)) if kind != "linear_attention"
    )


def tower_flops(cfg: RunConfig, d: Decisions, counts: ParamCounts) -> float:
    """The vision tower's matmul FLOPs on one micro batch's images: 2 a weight and a patch in
    the blocks and the patch embedding (the merger's weights once a merged token, of
    merge² patches), and per image and block bidirectional attention (QKᵀ and PV over the
    image's patches). A frozen tower runs forward only; an adapted one's backward takes the
    input gradients through every block (twice the forward's attention), and a recomputed
    one its forward again; its adapters as the language model's (forward, two backward)."""
    from memtune.memory.counts import tower_config
    from memtune.memory.vision import image_load

    load = image_load(cfg, d)
    if load is None or d.vision is None:
        return 0.0
    t = tower_config(cfg)
    patches = load.images * load.patches
    merged = patches / int(t.spatial_merge_size) ** 2
    # the learned position table (Qwen3-VL, Qwen3.5) is looked up, not multiplied
    table = int(getattr(t, "num_position_embeddings", 0) or 0) * int(t.hidden_size)
    blocks = counts.vision - counts.vision_merger - table
    weights = 2 * (patches * blocks + merged * counts.vision_merger)
    attention = 4 * load.images * load.patches**2 * int(t.hidden_size) * int(t.depth)
    if not d.vision.adapted:
        return float(weights + attention)
    again = 1 if d.vision.recompute else 0
    lora = 2 * patches * counts.vision_lora * (3 + again)
    return float(weights * (2 + again) + attention * (3 + again) + lora)


def dora_flops(cfg: RunConfig, d: Decisions, counts: ParamCounts) -> float:
    """DoRA's extra matmuls in one micro batch (peft's DoraLinearLayer), per adapted module of
    every layer: A and B over an identity matrix to build B·A as a weight (2·in²·r + 2·in·r·out,
    in each forward and recompute; no backward: the norms are detached); with dropout, the base
    weight applied once more to the dropped input (forward, recompute, input gradient: none in
    the projections reading the first layer's input where it needs no gradient). Not
    counted: its elementwise work on n × out tensors (memory-bound), which peft's benchmark
    (Llama-3.2-3B, r=32) puts the whole cost at +26% of the step."""
    if not cfg.peft.dora:
        return 0.0
    from memtune.memory.dora import dora_modules
    from memtune.memory.estimate import FIRST_NORM_READERS, layer_kinds

    k = d.checkpointing.recomputed
    flops = 0
    for index, kind in enumerate(layer_kinds(cfg)):
        inputs = (
            counts.linear_attention_lora_inputs
            if kind == "linear_attention"
            else counts.lora_inputs
        )
        modules = dora_modules(inputs, counts)
        passes = 2 if index < k else 1  # forward, and the recompute
        flops += passes * sum(2 * i * i * r + 2 * i * r * out for i, out, r in modules)
        if cfg.peft.dropout > 0:
            dropped = d.batch.rank_tokens * sum(2 * i * out for i, out, _ in modules)
            flops += (passes + 1) * dropped
            if index == 0 and first_input_needs_no_grad(d):  # no input gradient there
                readers = [x for x in inputs if x[0] in FIRST_NORM_READERS]
                flops -= d.batch.rank_tokens * sum(
                    2 * i * out for i, out, _ in dora_modules(readers, counts)
                )
    return float(flops)


def dropout_pass_bytes(cfg: RunConfig, d: Decisions, counts: ParamCounts) -> float:
    """What LoRA dropout reads and writes in one micro batch, per rank: over each adapted
    module's input (n × in; every adapter drops its own copy), the forward reads it and writes
    the copy and a 1-byte mask, a recompute does it again, the backward reads the gradient and
    the mask and writes the gradient. With the masks regenerated (kernels.lora_dropout) the
    backward drops the input once more first. The adapters reading the first layer's first
    norm run no dropout backward where that input needs no gradient (first_input_needs_no_grad:
    autograd computes none; a regenerated one still drops the input again for A's gradient).
    Memory-bound: priced at plan.device_gb_s."""
    if cfg.peft.dropout <= 0:
        return 0.0
    again = 1 if d.kernels.lora_dropout == "regenerate" else 0
    from memtune.memory.estimate import FIRST_NORM_READERS, layer_kinds

    n, b = d.batch.rank_tokens, compute_bytes(cfg)
    total = 0
    layers = zip(layer_kinds(cfg), d.checkpointing.layers, strict=False)
    for index, (kind, recompute) in enumerate(layers):
        inputs = (
            counts.linear_attention_lora_inputs
            if kind == "linear_attention"
            else counts.lora_inputs
        )
        passes = (2 if recompute == "keep" else 3) + again  # forward (+ a recompute) + backward
        total += passes * sum(n * i * (2 * b + 1) for _, i, _ in inputs)
        if index == 0 and first_input_needs_no_grad(d):  # no input gradient there
            total -= sum(n * i * (2 * b + 1) for name, i, _ in inputs if name in FIRST_NORM_READERS)
    return float(total)


def remade_adapters(counts: ParamCounts) -> list[tuple[int, int, bool]]:
    """(r, output width, whether B's output is kept) of each adapter whose output a selective
    layer's recompute makes again: every adapter but down_proj's. The recompute stops once it
    has remade what the backward needs (torch's early stop), and the last thing it needs is
    down_proj's input; down_proj's adapter output feeds only the residual add."""
    return [(r, out, kept) for name, r, out, kept in adapter_outputs(counts) if name != "down_proj"]


def selective_pass_bytes(cfg: RunConfig, d: Decisions, counts: ParamCounts) -> float:
    """What the memory-bound ops of the selective layers' recomputes (rank.layers) read and
    write in one micro batch, per rank. A selective layer's backward first runs its forward
    again up to down_proj's input, keeping its matmuls' and attention's outputs, so it runs
    again, per token:

    * both RMSNorms and Qwen3's per-head q / k norms (memory.norms.norm_forward_bytes);
    * rotary on q and k (transformers' rotate_half: a product, a negated half, a
      concatenation, a product, a sum: 10·b a value; Liger's in place: 2·b);
    * each adapter's scaled output added to its base output (the scale: read and write, the
      sum: two reads and a write) and, where the layer does not keep it, B's output made
      again; under QLoRA peft's 4-bit layer first copies the base output (``result.clone()``);
      the residual add after attention;
    * SiLU and its product with up's output (memory.mlp.swiglu_forward_bytes);
    * attention's calls' outputs concatenated, where they are (packed rows under sdpa_varlen,
      one call per KV head: memory.attention.output_concatenated).

    * under lora-int8, each 8-bit projection's input quantized again
      (:func:`int8_requantize_bytes`).

    LoRA dropout's passes in a recompute are :func:`dropout_pass_bytes`'. Priced at
    ``plan.device_gb_s``; ``tests/test_step_time.py`` checks the count against every op a
    traced full-width selective layer runs again (tools.step_trace) within 1%."""
    s = d.checkpointing.selective
    if not s:
        return 0.0
    a = cfg.model.architecture
    n, b = d.batch.rank_tokens, compute_bytes(cfg)
    h, inter, hd = int(a["hidden_size"]), int(a["intermediate_size"]), head_dim(a)
    heads, kv = int(a["num_attention_heads"]), int(a["num_key_value_heads"])
    total = 2 * norm_forward_bytes(d, n, h, b)
    if a.get("model_type") in QK_NORMED:
        total += norm_forward_bytes(d, n * heads, hd, b) + norm_forward_bytes(d, n * kv, hd, b)
    total += (2 * b if d.kernels.rope == "liger" else 10 * b) * n * (heads + kv) * hd
    total += 3 * b * n * h  # the residual add after attention
    copy = 2 * b if d.peft_method == "qlora" else 0
    for r, out, kept in remade_adapters(counts):
        total += n * ((5 * b + copy) * out + (0 if kept else b * (out + r)))
    total += swiglu_forward_bytes(d, n, inter, b)
    if output_concatenated(cfg, d):
        total += 2 * b * n * heads * hd  # read, and written whole
    if d.peft_method == "lora-int8":
        total += int8_requantize_bytes(cfg, counts, n)
    return float(s * total)


INT8_QUANTIZE_BYTES = 12
"""What bitsandbytes' CUDA ``int8_vectorwise_quant`` moves per input value under LLM.int8's
outlier threshold (transformers' default, 6.0), read from its source: ``|x|`` (2 bytes read, 2
written), its comparison to the threshold (2 + 1), two reductions over that mask (1 + 1),
then the quantizing kernel (2 + 1)."""


def int8_requantize_bytes(cfg: RunConfig, counts: ParamCounts, n: int) -> int:
    """What a selective layer's recompute moves to quantize its 8-bit projections' inputs
    again, for ``n`` tokens: bitsandbytes' MatMul8bitLt casts each input to fp16 (the compute
    dtype read, 2 bytes written) and quantizes it (:data:`INT8_QUANTIZE_BYTES`)
    before the matmul whose output the layer keeps. q, k and v each quantize the same input,
    gate and up another. down_proj's runs only where its adapter saves after it: the recompute
    stops at the last tensor the backward needs (torch's early stop)."""
    cast = compute_bytes(cfg) + 2
    adapted = {name for name, _, _ in counts.lora_inputs}
    widths = [
        i
        for name, i, _ in counts.linear_shapes
        if (short := name.split(".")[-1]) in (*QKV, "o_proj", *MLP_PROJECTIONS)
        and (short != "down_proj" or "down_proj" in adapted)
    ]
    return n * (cast + INT8_QUANTIZE_BYTES) * sum(widths)


def traffic(cfg: RunConfig, d: Decisions, counts: ParamCounts) -> list[tuple[str, float]]:
    """Bytes each rank sends per optimizer step, by collective (module docstring)."""
    ranks = d.batch.ranks
    if ranks <= 1:
        return []
    ring = (ranks - 1) / ranks
    b = compute_bytes(cfg)
    gas = d.batch.accumulation
    lora = counts.lora * b
    shared = ring * lora  # what a reduce-scatter or an all-gather of the adapters sends
    ep = expert_parallel(d)
    if ep > 1:
        # the experts' adapters (1/ep of them on a rank) are reduced and gathered over the
        # ranks holding the same experts (ranks / ep of them), the others over all
        group = ranks // ep
        experts = counts.expert_lora * b
        shared = ring * (lora - experts) + (group - 1) / group * experts / ep
    out = [("LoRA gradient reduce-scatter", gas * shared)]
    if ep > 1:
        moved, meta = step_exchange_bytes(cfg, d)
        out.append((f"expert all-to-alls (tokens, weights; ep={ep})", moved))
        out.append(("expert all-to-alls (row indices)", meta))
    sp = d.sequence_parallel
    if sp > 1:
        out.append((f"Ulysses all-to-alls (q, k, v, output; sp={sp})", gas * ulysses_bytes(cfg, d)))
    if d.zero_stage == 3:
        other = (counts.embedding + counts.head) * b
        if d.peft_method == "qlora":
            base = counts.linear * NF4_BYTES[cfg.peft.double_quant] + other
            stacks = expert_stack_bytes(cfg.peft.quant_type, counts.experts, counts.expert_rows)
        elif d.peft_method == "lora-int8":
            base = counts.linear + other
            stacks = expert_stack_bytes("int8", counts.experts, counts.expert_rows)
        else:  # a mixture's whole expert stacks are gathered, not only the routed experts
            base = counts.linear * b + other
            stacks = counts.experts * b
        if ep > 1:
            # the rest from every rank; a rank's experts (1/ep of the stacks and their
            # adapters) from the ranks / ep holding them (none to gather at ranks = ep)
            group = ranks // ep
            own = (stacks + counts.expert_lora * b) / ep
            gathers = gas * 2 * (ring * (base + lora - counts.expert_lora * b))
            out.append(("ZeRO-3 weight all-gathers (forward + backward)", gathers))
            if group > 1:
                moved = gas * 2 * (group - 1) / group * own
                out.append((f"ZeRO-3 expert all-gathers (over {group} ranks)", moved))
        else:
            gathers = gas * 2 * ring * (base + stacks + lora)
            out.append(("ZeRO-3 weight all-gathers (forward + backward)", gathers))
        if live_reference(cfg):
            out.append(("ZeRO-3 weight all-gathers (live reference forward)", gas * ring * base))
        if d.vision is not None:  # forward, and an adapted tower's backward
            passes = 2 if d.vision.adapted else 1
            tower = gas * passes * ring * counts.vision * b
            out.append(("ZeRO-3 vision tower all-gathers", tower))
    else:
        out.append(("LoRA weight all-gather after the step", shared))
    return out


def ulysses_bytes(cfg: RunConfig, d: Decisions) -> float:
    """What one micro batch's sequence-parallel all-to-alls send per rank: each layer's
    exchange (attention's q, k, v and output, or a linear-attention layer's q, k, v, z, a, b
    and output, each at its own widths: config.architecture) in forward, backward and every
    recompute — a selective layer's too (the all-to-alls are not operators its policy keeps) —
    of which (sp−1)/sp leaves the rank."""
    from memtune.memory.estimate import layer_kinds

    a, sp = dict(cfg.model.architecture), d.sequence_parallel
    again = d.checkpointing.recomputed + d.checkpointing.selective  # the first layers
    values = 0
    for index, kind in enumerate(layer_kinds(cfg)):
        if kind == "linear_attention":
            widths = linear_exchange_widths(a)
        else:
            widths = attention_exchange_widths(a, sp)
        values += (2 + (index < again)) * sum(widths)
    return d.batch.rank_tokens * values * compute_bytes(cfg) * (sp - 1) / sp


def step_time(cfg: RunConfig, d: Decisions, counts: ParamCounts | None = None) -> StepTime | None:
    """The model's estimate for ``cfg`` run as decided; None without ``plan.device_tflops``
    (nothing to divide FLOPs by)."""
    p = cfg.plan
    if not p.device_tflops:
        return None
    counts = counts or count_params(cfg)
    gas = d.batch.accumulation
    flops = gas * micro_step_flops(cfg, d, counts).total
    compute = flops / (p.device_tflops * 1e12 * p.mfu)
    if d.peft_method == "qlora":
        compute *= QLORA_COMPUTE
    host = 0.0
    if d.offload_activations:
        h = int(cfg.model.architecture["hidden_size"])
        host = gas * 2 * d.checkpointing.recomputed * d.batch.rank_tokens * h
        host *= compute_bytes(cfg)
    dropout = gas * dropout_pass_bytes(cfg, d, counts)
    selective = gas * selective_pass_bytes(cfg, d, counts)
    moved = traffic(cfg, d, counts)
    return StepTime(
        flops,
        compute,
        traffic=moved,
        link_gb_s=p.link_gb_s,
        host_bytes=host,
        host_link_gb_s=p.host_link_gb_s,
        dropout_bytes=dropout,
        selective_bytes=selective,
        selective_ops=SELECTIVE_OPS + (", int8" if d.peft_method == "lora-int8" else ""),
        device_gb_s=p.device_gb_s,
    )


def format_step_time(cfg: RunConfig, t: StepTime) -> str:
    p = cfg.plan
    head = (
        f"compute {t.compute_s:.2f} s ({t.flops / 1e12:,.0f} TFLOP at {p.device_tflops:g} "
        f"TFLOPS × {p.mfu:.0%} MFU)"
        + (f" + LoRA dropout {t.dropout_s:.2f} s" if t.dropout_s else "")
        + (f" + selective recompute {t.selective_s:.2f} s" if t.selective_s else "")
    )
    if t.priced:
        head = (
            f"{t.step_s:.2f} s = {head} + communication {t.comm_s:.2f} s "
            f"({t.comm_share:.0%} of the step)"
        )
    else:
        head = f"{t.seconds()}: {head}"
    lines = [f"step time (estimate, per optimizer step): {head}"]
    for what, nbytes in t.traffic:
        secs = f"{nbytes / (t.link_gb_s * 1e9):>7.2f} s" if t.link_gb_s else ""
        lines.append(f"  {what:<48}{nbytes / 1e9:>9.2f} GB  {secs}".rstrip())
    if t.traffic and not t.priced:
        lines.append(
            "  plan.link_gb_s is not set, so these bytes are not priced (the GPU preflight "
            "measures it: preflight.json; a 4×4090D box over PCIe without P2P: ~10)"
        )
    elif t.traffic:
        lines.append(
            f"  at {t.link_gb_s:g} GB/s bus bandwidth (plan.link_gb_s; the GPU preflight "
            f"measures it), no overlap with compute assumed; with full overlap "
            f"{t.overlapped_s:.2f} s"
        )
    passes = [
        ("LoRA dropout's passes over the adapted inputs", t.dropout_bytes, t.dropout_s),
        (f"selective layers' {t.selective_ops}", t.selective_bytes, t.selective_s),
    ]
    for what, nbytes, seconds in passes:
        if seconds:
            lines.append(
                f"  {what:<48}{nbytes / 1e9:>9.2f} GB  {seconds:>7.2f} s at {t.device_gb_s:g} "
                "GB/s (plan.device_gb_s), in the step"
            )
    if t.host_bytes:
        copy_s = t.host_bytes / (t.host_link_gb_s * 1e9)
        lines.append(
            f"  offloaded activations to the host and back {t.host_bytes / 1e9:>9.2f} GB  "
            f"{copy_s:>7.2f} s at {t.host_link_gb_s:g} GB/s (plan.host_link_gb_s), overlapped: "
            f"+{t.host_s:.2f} s"
        )
    return "\n".join(lines)
