"""One-shot GPU check of memtune on Qwen2.5-7B (issue #7): memory, speed, MFU, the plan's error.

    bash bench/gpu_check.sh                       # on the lent H200 (installs .whl/, see README)
    python -m bench.gpu_check --dry-run           # here, on CPU: the same code paths, tiny model

For LoRA r=16 on all linear layers over a bf16 base, and for QLoRA (NF4 base), at 4096 and
2048 tokens, one rank, it measures two sides on the same random-weight Qwen2.5-7B:

* **baseline** — the recipe users follow (``bench/baseline.py``'s ``training_args`` and
  ``CountingTrainer``): ``transformers.Trainer`` + peft LoRA, full gradient checkpointing, the
  model's own cross-entropy on full logits, no DeepSpeed; QLoRA with peft's
  ``prepare_model_for_kbit_training`` as its docs say;
* **memtune** — memtune's own pieces: ``memtune.rank.model.add_lora`` (``prepare_quantized``,
  selective checkpointing with ``checkpoint_layers=auto`` planned for a 24 GB card), the
  chunked loss (``CausalLMLoss``), ``build_optimizer``, ``build_ds_config`` and DeepSpeed
  ZeRO-3 at world size 1 through ``deepspeed.initialize``, and ``memtune.rank.loop.train``.

Each measurement records peak allocated memory, tokens/s over timed steps after warm-up, MFU
and the planner's prediction (``memtune.memory``) with its error. memtune's rows run with the
allocator capped at the 24 GB card they are planned for (``measure.cap_allocator``, as
Unsloth's rows); the baseline's run uncapped and record whether they fit that card
(``fits_cap``). Then, for QLoRA with memtune, the longest sequence whose step fits under a
24 GB cap (``set_per_process_memory_fraction``).

No checkpoint is read: the base is built from ``model.architecture`` (conf/model/*.yaml) with
random weights directly on the device. memtune's ``load_base_model`` (``from_pretrained``)
is the one piece bypassed: for LoRA the model is built with ``from_config`` while a
``HfDeepSpeedConfig`` is alive, so it is created under ``zero.Init`` exactly as
``from_pretrained`` creates it under ZeRO-3; for QLoRA every decoder ``nn.Linear`` becomes a
bitsandbytes ``Linear4bit`` quantized on the device with the settings of memtune's
``quantization_config`` (what ``from_pretrained`` does tensor by tensor), no ``zero.Init``
(memtune's quantized ZeRO-3 path does not use it either).

Then a mixture-of-experts block (phase ``moe-block``): one transformers
``Qwen3MoeSparseMoeBlock`` at Qwen3-30B-A3B's full width, bf16, random weights, forward and
backward on 4096 tokens, with memtune's LoRA on the routed experts (rank.experts: every expert
on its routed rows through torch's ``grouped_mm`` where torch allows, a Python loop over the
experts otherwise; the loop forced is a variant too) against peft's ``target_parameters`` over
transformers' ``grouped_mm``, both frozen, and memtune over NF4 and int8 stacks: step time,
tokens/s and peak memory of each.

Last, Qwen3.5 (issue #30; phases ``qwen35-torch`` and ``qwen35-fla``): the random-weight
Qwen3.5-2B, hybrid (3 of 4 layers Gated DeltaNet), with the LoRA of the qwen3.5-9b experiment,
trained on packed rows of 4096 tokens (cu_seq_lens as the loader gives them) through memtune's
per-sample path, once on transformers' torch code (flash-linear-attention blocked in that
process) and once on flash-linear-attention's Triton kernels: step time, tokens/s, peak
memory against the plan, which kernels transformers calls, and packed = alone (each sample's
loss and logits in a packed row as alone, in bf16).

Every phase runs in its own process (a crash, hang or leak stays there); each writes its
measurements as soon as they exist and the outputs are rewritten after each, so a timeout
still returns data. The phases share one budget, drawn on in priority order (``phases``): a
phase that does not fit is skipped and named for the next session. Writes
``<out>/gpu_check.json`` and ``<out>/gpu_check.md``.

First of all, the profile (issue #47; phases ``profile-memtune`` and ``profile-baseline``):
memtune's LoRA step and the usual recipe's at 2,048 tokens under ``torch.profiler``, each
operator's own time put in one kind (base and LoRA GEMMs, the recompute, attention, dropout,
norms, the loss head, dequantization, the optimizer with ZeRO, copies, communication, the device
idle), so every change is measured the same way.

After the main rows, the fused kernels one by one (issue #47 item 4; phase ``kernels``):
memtune's LoRA step at 2,048 tokens with every layer kernel torch, each of Liger's RMSNorm,
SwiGLU and rotary alone, all three, Liger's loss against the chunked head, and all of it, each
from the same restored trainable state: tokens/s, peak memory and equal loss. After the long
phases, ZeRO's own cost on one card (issue #47 item 7; phase ``zero-cost``): the same LoRA step
without DeepSpeed, then in its ZeRO-2 engine, on one model built once.

One module per concern: ``modes`` (GPU or dry run), ``configs`` (composition, plan records),
``bases`` (the random-weight base, quantized), ``measure`` (clocks, memory, census, timing,
MFU), ``batches``, ``phases`` (the priority order, the budget), ``recorder`` (a phase's
process and what it records), ``baseline_runner`` (Trainer + peft), ``memtune_runner``
(memtune, the cap search), ``profile`` (where a step's time goes), ``kernels`` (the fused
kernels one by one), ``zero_cost`` (DeepSpeed's own cost), ``hybrid`` (Qwen3.5), ``moe``
(the MoE block), ``unsloth`` and ``unsloth_report`` (Unsloth beside memtune), ``mixture``,
``mixture_load`` and ``mixture_report`` (a whole mixture on one card), ``report`` (collect,
markdown, the format check), ``orchestrate`` (the entry).

In their own device call (``--phases unsloth``, with ``.whl-unsloth/`` carried), Unsloth beside
memtune (issue #47 item 5): the same random-weight model saved with Qwen's tokenizer, Unsloth's
LoRA and QLoRA in its own environment (transformers 5.17, the image's), then memtune planned at
the memory Unsloth used.

In their own device call (``--phases mixture``; issue #48 item 6), a whole mixture on one card:
Qwen3-30B-A3B (random weights) QLoRA under a 24 GB cap as the planner fits it
(``mixture-qlora``: the candidates planned, the pick and why recorded; the base built on the
meta device and quantized a layer at a time, never whole in bf16), the streaming loader's peak
on a 12-layer Qwen3-30B-A3B written to local disk (``mixture-load``), and LoRA on every expert
with the optimizer on the host (``mixture-qlora-offload``). Not run on a GPU yet; the phases'
needs and caps are estimates. The next session with a GPU, after ``bash bench/gpu_wheels.sh``
and ``python -m bench.gpu_check --dry-run --phases mixture`` here::

    run(command="GPU_CHECK_TOTAL_S=560 bash bench/gpu_check.sh --phases mixture",
        carry=[".whl"], timeout_s=600)
    # only if the first names mixture-qlora-offload for the next session, with >= 6 min left:
    run(command="GPU_CHECK_TOTAL_S=300 bash bench/gpu_check.sh --phases mixture-qlora-offload "
        "--keep-parts", carry=[".whl"], timeout_s=330)
    give_back()
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))  # memtune is not installed on the device machine
sys.path.insert(0, str(ROOT / "bench"))  # bench/baseline.py and bench/moe_bench.py, by name
