"""A local checkpoint's files checked before any rank starts (memtune.model_files): cut-short
or missing weights, a config.json of another size or architecture, a folder without its
tokenizer, each one line naming the file, where the ranks would have failed or trained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memtune.config import ConfigError
from memtune.model_files import check_checkpoint
from memtune.tools.tiny import synthesize
from tests.conftest import compose_cfg, run_train_py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny Qwen2 (the real class, random weights) with its tokenizer, as a user's
    local checkpoint; each test copies it."""
    from memtune.config import to_run_config

    arch = dict(to_run_config(compose_cfg([])).model.architecture)
    return synthesize(tmp_path_factory.mktemp("models") / "tiny", arch)


def copy(tiny: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    return folder


def refusal(folder: Path) -> str:
    with pytest.raises(ConfigError) as err:
        check_checkpoint(folder)
    return str(err.value)


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def test_a_whole_checkpoint_passes(tiny: Path) -> None:
    check_checkpoint(tiny)


def test_cut_short_or_missing_weights_are_named(tiny: Path, tmp_path: Path) -> None:
    folder = copy(tiny, tmp_path)
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) - 100])
    assert refusal(folder) == (
        f"{weights} is truncated: {len(whole) - 100:,} bytes, its header says {len(whole):,}"
    )
    weights.write_bytes(whole[:1000])  # the header itself cut
    assert refusal(folder).startswith(f"{weights} is truncated: 1,000 bytes, shorter than its")
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json, really")
    assert refusal(folder).endswith(
        "its header is not safetensors' JSON (damaged, or not a safetensors file)"
    )
    weights.unlink()
    assert refusal(folder) == (
        f"{folder} has a config.json and no weights (model.safetensors, its index, or "
        "pytorch_model.bin): a download cut short, or the wrong folder?"
    )
    # sharded: the index names a shard that is not there
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    assert refusal(folder) == (
        f"{folder} has no model-00001-of-00002.safetensors, which model.safetensors.index.json "
        "names: a shard is missing"
    )


def test_a_config_of_another_model_is_named(tiny: Path, tmp_path: Path) -> None:
    folder = copy(tiny, tmp_path)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    edit_config(folder, vocab_size=10)
    said = refusal(folder)
    assert f"model.embed_tokens.weight [{vocab}, " in said and "(the model: [10, " in said
    assert said.endswith(
        "config.json and the weights come from different models; put the "
        "checkpoint's own config.json back"
    )
    # Qwen2's weights under a Llama config.json: its q/k/v biases would be dropped
    folder = copy(tiny, tmp_path / "b")
    edit_config(folder, model_type="llama", architectures=["LlamaForCausalLM"])
    said = refusal(folder)
    assert "tensors in the weights have no place in the llama model" in said
    assert "self_attn.k_proj.bias" in said


def test_weights_lacking_a_tensor_or_a_tokenizer_are_named(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy(tiny, tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert "the weights lack 1 of the model's tensors (model.layers.1.mlp.up_proj.weight)" in (
        refusal(folder)
    )
    folder = copy(tiny, tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (folder / name).unlink(missing_ok=True)
    assert refusal(folder).startswith(f"{folder} has no tokenizer (tokenizer.json, ")


def test_a_field_of_the_wrong_type_is_one_line_before_launch(tiny: Path, tmp_path: Path) -> None:
    """Through train.py: one line, exit 2, before any rank (the planner reads config.json)."""
    folder = copy(tiny, tmp_path)
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    edit_config(folder, hidden_size=str(hidden))
    args = ["model=local", f"model.name_or_path={folder}", f"run_dir={tmp_path / 'run'}"]
    proc = run_train_py([*args, "preprocess_only=true"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"memtune: config error: model.architecture ({folder}/config.json): transformers "
        f"refuses it as a qwen2 config: Field 'hidden_size' expected int, got str (value: "
        f"'{hidden}')"
    )


def test_a_mixture_stored_expert_by_expert_is_not_a_mismatch(tmp_path: Path) -> None:
    """transformers fuses a mixture's experts while loading; its saved checkpoints hold them
    one by one: with few experts those names are most of the file, and were refused."""
    from memtune.config import to_run_config

    arch = dict(to_run_config(compose_cfg(["model=tiny-qwen3-moe"])).model.architecture)
    folder = synthesize(tmp_path / "moe", arch)
    check_checkpoint(folder)
    edit_config(folder, num_local_experts=3)  # shapes still checked: the router's rows differ
    assert "model.layers.0.mlp.gate.weight" in refusal(folder)


def test_an_untied_head_missing_or_no_weights_at_all(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy(tiny, tmp_path)
    weights = load_file(folder / "model.safetensors")
    if "lm_head.weight" not in weights:  # tied in the demo: untie it, the head then saved
        pytest.skip("the demo model ties its head")
    del weights["lm_head.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert "the weights lack 1 of the model's tensors (lm_head.weight)" in refusal(folder)
    edit_config(folder, tie_word_embeddings=True)  # tied: the head is the embedding
    check_checkpoint(folder)
    (folder / "model.safetensors").unlink()
    check_checkpoint(folder, weights=False)  # preprocess_only: the tokenizer is what it needs
    assert "has a config.json and no weights" in refusal(folder)
