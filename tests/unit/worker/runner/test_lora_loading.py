"""Loading PEFT adapters: every config field is supported or refused by name, bad adapters are
refused naming the file and the field, and the revision is a digest of the content."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvfleet.worker.replica.adapter_catalog import check_catalog, expand_adapter_dirs, parse_adapter_arg
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.lora.config import AdapterError
from kvfleet.worker.runner.model_config import load_model_config


@pytest.fixture
def copy(tmp_path, tiny_adapters):
    """``copy(name, edit_config=None)``: a writable copy of an adapter dir."""
    def make(name: str, **config_changes) -> Path:
        out = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_adapters[name], out)
        if config_changes:
            path = out / "adapter_config.json"
            cfg = json.loads(path.read_text())
            cfg.update(config_changes)
            path.write_text(json.dumps(cfg))
        return out
    return make


def _check(tiny_llama_dir, path, max_rank: int = 16):
    return check_adapter("a", path, load_model_config(tiny_llama_dir), max_rank)


@pytest.mark.parametrize("field, value", [
    ("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all"), ("lora_bias", True),
    ("fan_in_fan_out", True), ("exclude_modules", ["q_proj"]), ("layer_replication", [[0, 2]]),
    ("trainable_token_indices", [1, 2]), ("target_parameters", ["x"]), ("use_qalora", True),
    ("peft_type", "IA3"), ("some_future_feature", {"on": True}), ("layers_pattern", "blocks"),
])
def test_unsupported_config_fields_are_refused_by_name(tiny_llama_dir, copy, field, value) -> None:
    path = copy("qv", **{field: value})
    with pytest.raises(AdapterError, match=rf"adapter_config.json: field '{field}'"):
        _check(tiny_llama_dir, path)


def test_training_only_fields_and_defaults_are_accepted(tiny_llama_dir, copy) -> None:
    spec = _check(tiny_llama_dir, copy("qv", lora_dropout=0.1, init_lora_weights="gaussian",
                                       use_dora=False, modules_to_save=None, bias="none"))
    assert {t.module for t in spec.config.targets} == {"q_proj", "v_proj"}


def test_rank_above_max_lora_rank_is_refused(tiny_llama_dir, tiny_adapters) -> None:
    with pytest.raises(AdapterError, match=r"field 'r' \(rank 8 .*exceeds --max-lora-rank 4"):
        _check(tiny_llama_dir, tiny_adapters["all"], max_rank=4)


def test_a_target_module_the_model_lacks_is_refused(tiny_llama_dir, copy) -> None:
    with pytest.raises(AdapterError, match="field 'target_modules' names module.*fc1"):
        _check(tiny_llama_dir, copy("qv", target_modules=["q_proj", "fc1"]))
    with pytest.raises(AdapterError, match="matches no projection"):
        _check(tiny_llama_dir, copy("qv", target_modules=r".*\.fc\d"))


def test_shapes_that_do_not_match_the_base_are_refused(tiny_llama_dir, copy) -> None:
    path = copy("qv")
    weights = load_file(path / "adapter_model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.lora_B.weight"))
    weights[name] = weights[name][:-1]
    save_file(weights, path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=rf"adapter_model.safetensors: tensor {name} has shape"):
        _check(tiny_llama_dir, path)


def test_a_missing_or_extra_tensor_is_refused(tiny_llama_dir, copy) -> None:
    path = copy("qv", target_modules=["q_proj", "k_proj", "v_proj"])
    with pytest.raises(AdapterError, match="k_proj.lora_A.weight missing"):
        _check(tiny_llama_dir, path)
    path = copy("qv", target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="v_proj.lora_.* is not a LoRA update of a targeted"):
        _check(tiny_llama_dir, path)


def test_pickled_bin_is_never_loaded(tiny_llama_dir, copy) -> None:
    path = copy("qv")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(AdapterError, match="adapter_model.safetensors: not found.*never loaded"):
        _check(tiny_llama_dir, path)


def test_revision_is_a_content_digest(tiny_llama_dir, tiny_adapters, copy) -> None:
    qv = _check(tiny_llama_dir, tiny_adapters["qv"])
    assert _check(tiny_llama_dir, copy("qv")).revision == qv.revision  # same bytes elsewhere
    assert _check(tiny_llama_dir, tiny_adapters["qv2"]).revision != qv.revision  # new weights
    assert _check(tiny_llama_dir, copy("qv", lora_alpha=4)).revision != qv.revision  # new config


def test_cli_adapter_arguments(tiny_llama_dir, tiny_adapters, tmp_path) -> None:
    assert parse_adapter_arg("sql=/x/y") == ("sql", "/x/y")
    for bad in ("sql", "=dir", "has space=/x", "sql="):
        with pytest.raises(ValueError):
            parse_adapter_arg(bad)
    pairs = expand_adapter_dirs([("one", str(tiny_adapters["qv"]))],
                                [str(tiny_adapters["qv"].parent)])
    assert [n for n, _ in pairs] == ["one", "all", "qv", "qv2", "rs"]
    with pytest.raises(ValueError, match="'qv' is given twice"):
        expand_adapter_dirs([("qv", "/x")], [str(tiny_adapters["qv"].parent)])
    with pytest.raises(AdapterError, match="adapter 'one': .*qv/adapter_config.json: field 'r'.*--max-lora-rank 2"):
        check_catalog(pairs, load_model_config(tiny_llama_dir), 2)


def test_an_adapter_on_phi3_s_fused_modules_is_refused_naming_them(tiny_phi3_dir, adapter_factory) -> None:
    """Phi-3 stores q|k|v and gate|up fused (``qkv_proj``, ``gate_up_proj``): an adapter of
    those modules is refused at load, by name, rather than read into the wrong columns."""
    with pytest.raises(AdapterError, match="qkv_proj"):
        check_adapter("a", adapter_factory(tiny_phi3_dir, "all"), load_model_config(tiny_phi3_dir), 16)
