"""Safetensors loading (single and sharded), KV cache sizing and copy-on-write copies."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvfleet.allocator.kv_bytes import bytes_per_token
from kvfleet.allocator.model_spec import spec_from_config
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.runner.kv_cache import KVCache, kv_bytes_per_block, num_blocks_for_memory
from kvfleet.worker.runner.model_config import load_model_config
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.weights import load_weights, weight_files


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, tiny_llama_dir):
    import transformers

    out = tmp_path_factory.mktemp("sharded")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="2MB")
    return out


def test_sharded_checkpoint_loads_like_single_file(sharded_dir, tiny_llama_dir) -> None:
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(weight_files(sharded_dir)) > 1
    one, many = load_weights(tiny_llama_dir), load_weights(sharded_dir)
    assert one.keys() == many.keys()
    assert all(torch.equal(one[k], many[k]) for k in one)
    assert load_weights(sharded_dir, torch.bfloat16)["lm_head.weight"].dtype == torch.bfloat16


def test_sharded_checkpoint_runs(sharded_dir, tiny_llama_dir) -> None:
    plan = StepPlan((SeqChunk("a", (5, 6, 7), 0, (3,)),))
    a = ModelRunner(sharded_dir, num_blocks=4, block_size=4).execute(plan)
    b = ModelRunner(tiny_llama_dir, num_blocks=4, block_size=4).execute(plan)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # same weights; matmul alignment may differ


def test_missing_weights_are_named(tmp_path, sharded_dir) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        weight_files(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(sharded_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    (broken / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        weight_files(broken)


def test_missing_tensor_is_an_error(tmp_path, tiny_llama_dir) -> None:
    from safetensors.torch import save_file

    weights = load_weights(tiny_llama_dir)
    del weights["model.layers.1.mlp.up_proj.weight"]
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="up_proj"):
        ModelRunner(tmp_path, num_blocks=2, block_size=4)


def test_unused_tensor_is_an_error(tmp_path, tiny_llama_dir) -> None:
    """A bias the config does not announce must not be dropped silently."""
    from safetensors.torch import save_file

    weights = load_weights(tiny_llama_dir)
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unused.*q_proj.bias"):
        ModelRunner(tmp_path, num_blocks=2, block_size=4)


def test_kv_bytes_per_block(smollm2_dir) -> None:
    config = load_model_config(smollm2_dir)
    # K + V x 30 layers x 16 tokens x 3 kv heads x 64 dims x 4 bytes
    assert ModelRunner.kv_bytes_per_block(config, 16, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4 == 737_280
    assert kv_bytes_per_block(config, 16, torch.bfloat16) == 368_640
    assert num_blocks_for_memory(config, 16, torch.float32, 1 << 30) == (1 << 30) // 737_280
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_memory(config, 16, torch.float32, 737_279)
    cache = KVCache(config, num_blocks=3, block_size=16)
    assert cache.nbytes == 3 * 737_280
    # The same figure `kvfleet budget` derives from config.json (one formula, the allocator's).
    assert 16 * bytes_per_token(spec_from_config(smollm2_dir), "fp32") == 737_280
    assert cache.layer(29)[0].shape == (3, 16, 3, 64)


def test_copy_blocks_copies_every_layer_k_and_v(tiny_llama_dir) -> None:
    config = load_model_config(tiny_llama_dir)
    cache = KVCache(config, num_blocks=5, block_size=4)
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.data.clone()
    cache.copy_blocks(((1, 3), (2, 0)))
    assert torch.equal(cache.data[:, :, 3], before[:, :, 1])
    assert torch.equal(cache.data[:, :, 0], before[:, :, 2])
    assert torch.equal(cache.data[:, :, [1, 2, 4]], before[:, :, [1, 2, 4]])
