"""``kvfleet budget``: every reference number from the config files alone, same as the Python API;
errors are one line on stderr naming the field or flag, exit status non-zero."""

import json

import pytest

from kvfleet.allocator.units import GiB, KiB, MiB
from kvfleet.deploy.budget import main

from .conftest import config_path, load

REQUIRED_KEYS = {
    "bytes_per_token", "bytes_per_token_per_rank", "kv_bytes", "kv_bytes_per_rank",
    "reserved_tokens_per_request", "tail_waste_tokens", "scale_bytes_per_token",
    "recurrent_state_bytes_per_request",
}
MEMORY_KEYS = {"weights_bytes", "available_kv_bytes", "max_concurrent_requests"}


def budget(capsys, model, *flags):
    assert main([str(config_path(model)), *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert REQUIRED_KEYS <= out.keys()
    assert all(isinstance(out[k], int) for k in REQUIRED_KEYS)
    return out


def fails(capsys, argv, expected):
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("kvfleet budget: error: "), err
    assert expected in err, err
    return err


def test_llama_2_7b_defaults_to_its_context(capsys):
    r = budget(capsys, "llama-2-7b")
    assert r["context"] == 4096 and r["batch"] == 1 and r["kv_dtype"] == "bf16"
    assert r["kv_bytes"] == 2 * GiB
    assert (r["scale_bytes_per_token"], r["recurrent_state_bytes_per_request"]) == (0, 0)
    assert not MEMORY_KEYS & r.keys()


def test_llama_3_8b(capsys):
    r = budget(capsys, "llama-3-8b", "--context", "4096")
    assert (r["bytes_per_token"], r["kv_bytes"]) == (131072, 512 * MiB)


def test_gemma_2_27b(capsys):
    r = budget(capsys, "gemma-2-27b")                      # context 8192 from the config
    assert r["bytes_per_token"] == 376832
    assert r["kv_bytes"] == 2315255808
    assert budget(capsys, "gemma-2-27b", "--context", "4096")["kv_bytes"] == 376832 * 4096


def test_qwen3_0_6b_reads_its_explicit_head_dim(capsys):
    r = budget(capsys, "qwen3-0.6b")                       # context 40960 from the config
    per_token = 28 * 2 * 8 * 128 * 2                       # layers, K+V, KV heads, head_dim, bf16
    assert (r["context"], r["bytes_per_token"]) == (40960, per_token) and per_token == 114688
    assert r["kv_bytes"] == per_token * 40960


def test_gemma_3_1b_layer_windows(capsys):
    r = budget(capsys, "gemma-3-1b-it")
    layer_token = 2 * 1 * 256 * 2                          # K+V, 1 KV head, head_dim 256, bf16
    assert r["bytes_per_token"] == 26 * layer_token
    # 4 global layers keep all 32768 tokens, 22 local ones their last 512
    assert r["kv_bytes"] == (4 * 32768 + 22 * 512) * layer_token == 145752064
    assert "22 sliding (512 tokens) + 4 full" in r["description"]


def test_phi_4_mini_budgets_the_served_context(capsys):
    r = budget(capsys, "phi-4-mini-instruct")
    assert r["context"] == 4096 and r["bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert r["kv_bytes"] == 512 * MiB


def test_qwen2_5_32b_batch(capsys):
    r = budget(capsys, "qwen2.5-32b", "--context", "8192", "--batch", "20")
    assert (r["bytes_per_token"], r["kv_bytes"]) == (262144, 40 * GiB)
    r = budget(capsys, "qwen2.5-32b", "--context", "8192", "--batch", "20", "--tp", "2")
    assert r["kv_bytes_per_rank"] == 20 * GiB


def test_deepseek_v3_and_gpt2_xl(capsys):
    assert budget(capsys, "deepseek-v3", "--context", "1")["bytes_per_token"] == 70272
    r = budget(capsys, "deepseek-v3", "--context", "1", "--tp", "8")
    assert r["bytes_per_token_per_rank"] == 70272              # latent replicated
    assert budget(capsys, "gpt2-xl")["bytes_per_token"] == 307200 == 300 * KiB


def test_llama_3_1_405b_per_rank(capsys):
    r = budget(capsys, "llama-3.1-405b", "--tp", "8", "--context", "8192")
    assert r["bytes_per_token"] == 504 * KiB
    assert r["bytes_per_token_per_rank"] == 63 * KiB
    r = budget(capsys, "llama-3.1-405b", "--tp", "8", "--context", "8192", "--kv-dtype", "fp8")
    assert r["bytes_per_token_per_rank"] == 31.5 * KiB
    assert r["scale_bytes_per_token"] > 0                      # reported, not in the payload


def test_the_24_gib_scenario(capsys):
    r = budget(capsys, "llama-2-7b", "--memory", "24GiB", "--params", "7e9",
               "--reserve", "2GiB")
    assert MEMORY_KEYS <= r.keys()
    assert r["weights_bytes"] == 14 * 10**9
    assert r["available_kv_bytes"] == 24 * GiB - 14 * 10**9 - 2 * GiB
    assert r["max_concurrent_requests"] == 4
    assert budget(capsys, "llama-2-7b", "--memory", "24GiB", "--params", "7B",
                  "--reserve", "2GiB")["max_concurrent_requests"] == 4


def test_405b_does_not_fit_an_80_gib_rank_and_says_so(capsys):
    argv = [str(config_path("llama-3.1-405b")), "--tp", "8", "--memory", "80GiB",
            "--params", "405B", "--context", "4096"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "94.2964 GiB" in out
    r = budget(capsys, "llama-3.1-405b", *argv[1:])
    assert r["max_concurrent_requests"] == 0 and r["shortfall_bytes"] > 0


def test_tail_waste(capsys):
    r = budget(capsys, "llama-3-8b", "--context", "17")
    assert (r["reserved_tokens_per_request"], r["tail_waste_tokens"]) == (32, 15)
    r = budget(capsys, "llama-3-8b", "--context", "5", "--block-size", "4")
    assert (r["reserved_tokens_per_request"], r["tail_waste_tokens"]) == (8, 3)


def test_jamba_recurrent_state(capsys):
    r = budget(capsys, "jamba-1.5-mini")
    assert r["kv_bytes"] == 4 * GiB                             # 256K context
    assert r["recurrent_state_bytes_per_request"] == 28 * 8192 * 20 * 2


def test_num_kv_heads_flag(capsys, write_config):
    cfg = {"model_type": "mystery", "num_hidden_layers": 2, "num_attention_heads": 2,
           "head_dim": 4, "hidden_size": 8, "max_position_embeddings": 8}
    path = str(write_config(cfg))
    fails(capsys, [path], "num_key_value_heads")
    assert main([path, "--num-kv-heads", "2", "--context", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes"] == 192   # the toy hand count


def test_human_table_has_units(capsys):
    assert main([str(config_path("llama-2-7b")), "--memory", "24GiB", "--params", "7e9",
                 "--reserve", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert "2147483648 B (2 GiB)" in out
    assert "14000000000 B (13.0385 GiB)" in out
    assert "4 requests of 4096 tokens" in out


@pytest.mark.parametrize("flags, expected", [
    (["--tp", "3"], "num_attention_heads"),
    (["--tp", "0"], "--tp"),
    (["--context", "9000"], "--context"),
    (["--context", "0"], "--context"),
    (["--batch", "0"], "--batch"),
    (["--block-size", "0"], "--block-size"),
    (["--kv-dtype", "int4"], "--kv-dtype"),
    (["--memory", "24G", "--params", "7B"], "--memory"),
    (["--memory", "24GiB"], "--params"),
    (["--memory", "24GiB", "--params", "7X"], "--params"),
    (["--params", "7B"], "--params"),
    (["--memory", "24GiB", "--params", "7B", "--margin", "1"], "--margin"),
    (["--memory", "24GiB", "--params", "7B", "--reserve", "lots"], "--reserve"),
    (["--bogus"], "--bogus"),
])
def test_flag_errors(capsys, flags, expected):
    fails(capsys, [str(config_path("llama-3-8b")), *flags], expected)


def test_config_errors_name_the_field(capsys, tmp_path, write_config):
    fails(capsys, [str(tmp_path / "nope.json")], "config.json")
    cfg = load("llama-3-8b")
    del cfg["num_hidden_layers"]
    fails(capsys, [str(write_config(cfg))], "num_hidden_layers")
    fails(capsys, [str(config_path("falcon-7b"))], "max_position_embeddings")
    fails(capsys, [], "CONFIG_JSON")


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "usage: kvfleet budget" in capsys.readouterr().out


def test_lora_slots_are_counted_and_taken_from_the_kv_memory(capsys):
    # Llama-2-7B: 32 layers, hidden 4096, 32 heads of 128 (q = kv = 4096), MLP 11008.
    per_layer = 3 * (4096 + 4096) + 2 * (4096 + 11008) + (4096 + 4096) + (11008 + 4096)
    r = budget(capsys, "llama-2-7b", "--max-loras", "4", "--max-lora-rank", "16")
    assert r["lora_slot_bytes"] == per_layer * 32 * 16 * 2  # bf16 weights
    assert r["lora_bytes"] == 4 * r["lora_slot_bytes"]
    # tp=2: B of q/k/v/gate/up and A of o/down split, the other factor replicated.
    split = 3 * (4096 + 2048) + 2 * (4096 + 5504) + (2048 + 4096) + (5504 + 4096)
    r2 = budget(capsys, "llama-2-7b", "--max-loras", "4", "--max-lora-rank", "16", "--tp", "2")
    assert r2["lora_bytes_per_rank"] == 4 * split * 32 * 16 * 2
    plain = budget(capsys, "llama-2-7b", "--memory", "24GiB", "--params", "7B")
    with_lora = budget(capsys, "llama-2-7b", "--memory", "24GiB", "--params", "7B",
                       "--max-loras", "4", "--max-lora-rank", "16")
    assert plain["available_kv_bytes"] - with_lora["available_kv_bytes"] == with_lora["lora_bytes"]
    fails(capsys, [str(config_path("llama-2-7b")), "--max-loras", "2", "--max-lora-rank", "0"],
          "--max-lora-rank")
