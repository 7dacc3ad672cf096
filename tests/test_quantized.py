"""QLoRA (NF4) and LLM.int8 bases train on 2 real CPU ranks under ZeRO-2 and ZeRO-3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import Run, quantized

# Every linear layer of both decoder layers is quantized and carries LoRA.
QUANTIZED_LAYERS = 2 * 7
STORED = {"qlora": ("Linear4bit", "torch.bfloat16"), "lora-int8": ("Linear8bitLt", "torch.int8")}


@pytest.fixture(params=["qlora-nf4:zero2", "qlora-nf4:zero3", "lora-int8:zero2", "lora-int8:zero3"])
def quantized_run(request, runs_root: Path) -> Run:
    return quantized(runs_root, request.param)


def test_quantized_base_trains_and_staysquantized(quantized_run: Run) -> None:
    run = quantized_run
    losses = run.losses()
    assert len(losses) == run.cfg.trainer.max_steps and all(
        map(torch.isfinite, torch.tensor(losses))
    )
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses
    probes = run.probes()
    layer, dtype = STORED[run.cfg.peft.method]
    for probe in probes:
        assert probe["quantized"] == {layer: dtype}
        assert probe["quantized_modules"] == QUANTIZED_LAYERS
        # Frozen quantized weights, norms and embeddings: byte-identical to a fresh load.
        assert probe["base_tensors_checked"] > 20 and probe["base_changed"] == []
        assert probe["lora_b_tensors"] == QUANTIZED_LAYERS and probe["lora_b_all_zero"] == []
    # Every rank ends with the same adapters.
    assert probes[0]["lora_sha256"] == probes[1]["lora_sha256"]
    if run.cfg.zero.stage == 3:  # the quantized base is sharded too
        assert all(0.45 < p["held_params"] / p["total_params"] < 0.55 for p in probes)
    adapter = load_file(run.dir / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * QUANTIZED_LAYERS
    assert all(t.abs().max() > 0 for k, t in adapter.items() if "lora_B" in k)
    assert run.summary()["trainable_params"] == sum(t.numel() for t in adapter.values())


MERGE_TEXT = "<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n"


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def test_qlora_adapter_merges_into_the_dequantized_base(runs_root: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memtune.merge import merge
    from memtune.model import is_quantized_layer, load_base_model, prepare_quantized, torch_dtype

    run = quantized(runs_root, "qlora-nf4:zero2")
    adapter = run.dir / "adapter"
    ids = AutoTokenizer.from_pretrained(str(adapter))(MERGE_TEXT, return_tensors="pt").input_ids
    # What was trained: the NF4 base (prepared as in training) plus the adapter.
    base = prepare_quantized(load_base_model(run.cfg, "sdpa"), torch_dtype(run.cfg))
    trained = PeftModel.from_pretrained(base, str(adapter)).eval()
    for module in trained.modules():  # evaluated in fp32, like the fp32 merges below
        if is_quantized_layer(module):
            module.compute_dtype = torch.float32
        else:
            for p in module.parameters(recurse=False):
                p.data = p.data.float()
    logits = {}
    with torch.no_grad():
        logits["trained"] = trained(input_ids=ids).logits.float()
        for into in ("dequantized", "original"):
            out = merge(adapter, tmp_path / into, dtype="fp32", into=into)
            merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
            assert not any("lora" in n for n, _ in merged.named_parameters())
            logits[into] = merged(input_ids=ids).logits.float()
    deq = _cosine(logits["dequantized"], logits["trained"])
    orig = _cosine(logits["original"], logits["trained"])
    print(f"cosine to the trained model: dequantized {deq:.6f}, original {orig:.6f}")
    assert deq > 0.9999 and deq > orig


def test_quantized_base_keeps_activations_in_the_compute_dtype(tmp_path: Path) -> None:
    """No fp32 upcast from prepare_model_for_kbit_training: it would make the residual stream
    (and so every activation kept for backward) fp32, twice the memory."""
    from memtune.config import to_run_config
    from memtune.model import count_parameters, load_base_model, prepare_quantized
    from memtune.tiny import synthesize
    from tests.conftest import compose_cfg

    cfg = to_run_config(compose_cfg(["peft=qlora-nf4", "trainer.precision=bf16"]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    plain_cfg = to_run_config(compose_cfg(["trainer.precision=bf16"]))
    model = prepare_quantized(load_base_model(cfg, "sdpa"), torch.bfloat16)
    out = model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert {h.dtype for h in out.hidden_states} == {torch.bfloat16}
    assert out.logits.dtype == torch.bfloat16
    # Parameter counts see through the 4-bit packing: the same as the unquantized model.
    plain = load_base_model(plain_cfg, "sdpa")
    assert count_parameters(model)[1] == count_parameters(plain)[1] == plain.num_parameters()
