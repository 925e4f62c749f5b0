"""kv_budget: reservations, tail waste and the capacity of one rank (reference lesson numbers)."""

import pytest

from kvfleet.allocator.kv_budget import (
    CapacityError,
    plan_capacity,
    reserve_slots,
    reserved_request_bytes,
    weight_bytes,
)
from kvfleet.allocator.kv_bytes import ShardingError, rank_spec, request_kv_bytes
from kvfleet.allocator.units import GB, GiB, MiB

from .conftest import spec


def test_paging_reservations_block_size_4():
    first = reserve_slots([5, 3], 4)       # A on two blocks, B on one
    assert (first.reserved_tokens, first.live_tokens, first.tail_waste_tokens) == (12, 8, 4)
    grown = reserve_slots([9, 3], 4)       # A needs a third block
    assert (grown.reserved_tokens, grown.live_tokens) == (16, 12)
    assert reserve_slots([13, 3], 4).reserved_tokens == 20


def test_17_tokens_in_16_token_blocks_reserve_32_and_waste_15():
    r = reserve_slots([17], 16)
    assert (r.reserved_tokens, r.tail_waste_tokens) == (32, 15)


def test_reserve_slots_refuses_bad_input():
    with pytest.raises(CapacityError, match="^--block-size: "):
        reserve_slots([1], 0)
    with pytest.raises(CapacityError, match="^--context: "):
        reserve_slots([-1], 16)


def test_weights_7b_bf16_are_14_gb_not_14_gib():
    w = weight_bytes(7 * 10**9, "bf16")
    assert w == 14 * GB
    assert round(w / GiB, 4) == 13.0385


def test_the_24_gib_scenario_fits_four_requests():
    plan = plan_capacity(spec("llama-2-7b"), memory_bytes=24 * GiB, num_params=7 * 10**9,
                         reserve_bytes=2 * GiB, tokens_per_request=4096)
    assert plan.weights_bytes == 14 * GB
    assert plan.available_kv_bytes == 24 * GiB - 14 * GB - 2 * GiB
    assert round(plan.available_kv_bytes / GiB, 4) == 8.9615
    assert plan.request_bytes == 2 * GiB
    assert plan.max_concurrent_requests == 4
    assert plan.block_bytes == 16 * 512 * 1024 == 8 * MiB
    assert plan.num_blocks == 1147
    assert plan.num_blocks // (4096 // 16) == 4
    assert plan.shortfall_bytes == 0


def test_405b_weights_per_rank():
    s = spec("llama-3.1-405b")
    bf16 = plan_capacity(s, memory_bytes=80 * GiB, num_params=405 * 10**9, tp=8,
                         tokens_per_request=4096)
    assert round(405 * 10**9 * 2 / GiB, 2) == 754.37
    assert round(bf16.weights_bytes / GiB, 2) == 94.30
    assert bf16.available_kv_bytes == 0 and bf16.max_concurrent_requests == 0
    assert bf16.shortfall_bytes == bf16.weights_bytes - 80 * GiB
    fp8 = plan_capacity(s, memory_bytes=80 * GiB, num_params=405 * 10**9, tp=8,
                        weight_dtype="fp8", tokens_per_request=4096)
    assert round(fp8.weights_bytes / GiB, 2) == 47.15


def test_qwen2_5_32b_on_two_80_gib_devices():
    s = spec("qwen2.5-32b")
    plan = plan_capacity(s, memory_bytes=80 * GiB, num_params=32 * 10**9, tp=2,
                         tokens_per_request=8192)
    assert round(2 * plan.weights_bytes / GiB, 2) == 59.60
    kv_for_20 = 20 * plan.request_bytes          # per rank
    assert 2 * kv_for_20 == 40 * GiB
    assert round((2 * plan.weights_bytes + 2 * kv_for_20) / GiB, 2) == 99.60
    left = 2 * (plan.available_kv_bytes - kv_for_20)
    assert round(left / GiB, 2) == 60.40
    assert plan.max_concurrent_requests >= 20


def test_margin_and_reserve_come_off_the_top():
    s = spec("llama-3-8b")
    plan = plan_capacity(s, memory_bytes=80 * GB, weights_bytes=16 * GB, reserve_bytes=GiB,
                         margin=0.1, tokens_per_request=8192)
    assert plan.margin_bytes == 8 * GB
    assert plan.available_kv_bytes == 80 * GB - 16 * GB - GiB - 8 * GB


def test_block_rounding_counts_in_capacity():
    s = spec("llama-3-8b")
    assert reserved_request_bytes(s, 17, "bf16", 16) == 32 * 131072


def test_windows_and_recurrent_state_count_per_request():
    gemma = spec("gemma-2-27b")
    assert reserved_request_bytes(gemma, 8192, "bf16", 16) == request_kv_bytes(gemma, 8192)
    jamba = spec("jamba-1.5-mini")
    state = 28 * 8192 * 20 * 2
    assert reserved_request_bytes(jamba, 1000, "bf16", 16) == 1008 * 16384 + state


def test_fp8_capacity_includes_scales():
    s = rank_spec(spec("llama-3.1-405b"), 8)
    payload = 8192 * 63 * 1024 // 2
    scales = 8192 * 126 * 2 * 4
    assert reserved_request_bytes(s, 8192, "fp8", 16) == payload + scales


@pytest.mark.parametrize("kwargs, flag", [
    ({"memory_bytes": 0}, "--memory"),
    ({"reserve_bytes": -1}, "--reserve"),
    ({"margin": 1.0}, "--margin"),
    ({"margin": -0.1}, "--margin"),
    ({"block_size": 0}, "--block-size"),
    ({"tokens_per_request": 0}, "--context"),
    ({"num_params": None}, "--params"),
    ({"num_params": 0}, "--params"),
])
def test_capacity_refusals_name_the_flag(kwargs, flag):
    args = dict(memory_bytes=80 * GB, num_params=8 * 10**9, tokens_per_request=4096)
    args.update(kwargs)
    with pytest.raises(CapacityError, match=f"^{flag}: "):
        plan_capacity(spec("llama-3-8b"), **args)


def test_capacity_refuses_unsplittable_tp():
    with pytest.raises(ShardingError):
        plan_capacity(spec("llama-3-8b"), memory_bytes=80 * GB, num_params=8 * 10**9,
                      tokens_per_request=4096, tp=3)
