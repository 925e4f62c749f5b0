"""Layer groups and the window-sized block tables of :class:`KVCacheManager`, and the budget's
capacity agreeing with the pool's arithmetic."""

from __future__ import annotations

import pytest

from kvfleet.allocator.kv_budget import group_blocks, plan_capacity, pool_groups, request_pages
from kvfleet.allocator.kv_cache_manager import NULL_BLOCK, ComputedBlocks, KVCacheManager
from kvfleet.allocator.layer_groups import LayerGroups
from kvfleet.allocator.model_spec import spec_from_config

GEMMA3_PATTERN = [512] * 5 + [None]  # five sliding layers of window 512 per full one


def test_groups_of_equal_size_full_first():
    g = LayerGroups.from_windows(GEMMA3_PATTERN * 3)  # 15 sliding, 3 full: groups of 3
    assert g.layers_per_group == 3 and g.num_groups == 6
    assert g.windows == (None, 512, 512, 512, 512, 512)
    assert g.layers[0] == (5, 11, 17) and g.layers[1] == (0, 1, 2)
    assert g.group_of(11) == 0 and g.slot_of(11) == 1 and g.group_of(4) == 2
    assert LayerGroups.from_windows([8] * 4) == LayerGroups(((0, 1, 2, 3),), (8,))
    assert LayerGroups.from_windows([None] * 4) == LayerGroups.single(4)
    assert LayerGroups.from_windows([8, None] * 2).layers == ((1, 3), (0, 2))  # gpt-oss style
    assert LayerGroups.from_windows([4, None, 4]).layers_per_group == 1


@pytest.mark.parametrize("bad", [[], [0, None]])
def test_groups_refuse_bad_windows(bad):
    with pytest.raises(ValueError):
        LayerGroups.from_windows(bad)


def test_a_sliding_group_releases_blocks_behind_its_window():
    kv = KVCacheManager(40, 4, windows=(None, 6))
    assert kv.allocate_slots("s", 10) is not None          # 3 blocks in each group
    assert kv.free_out_of_window("s", 10) == 1             # next query (10) sees 5..10
    full, sliding = kv.block_tables("s")
    assert NULL_BLOCK not in full and sliding[0] == NULL_BLOCK and NULL_BLOCK not in sliding[1:]
    assert kv.num_blocks("s") == 5
    kv.allocate_slots("s", 20)
    assert kv.free_out_of_window("s", 20) == 2             # 15..20: blocks 3.. needed
    assert kv.block_tables("s")[1][:3] == (NULL_BLOCK,) * 3
    kv.check_invariants()
    kv.free("s")
    assert kv.num_free_blocks == 40
    kv.check_invariants()


def test_one_full_group_is_the_manager_without_groups():
    a, b = KVCacheManager(10, 4), KVCacheManager(10, 4, windows=(None,))
    for kv in (a, b):
        kv.allocate_slots("s", 9)
        assert kv.free_out_of_window("s", 9) == 0
    assert a.block_table("s") == b.block_table("s") == [0, 1, 2]


def test_prefix_hit_needs_full_blocks_to_n_and_sliding_blocks_over_the_window():
    hashes = [bytes([i]) * 16 for i in range(6)]
    kv = KVCacheManager(40, 4, windows=(None, 6))
    kv.allocate_slots("a", 24)
    kv.cache_full_blocks("a", hashes, 24)
    kv.free_out_of_window("a", 24)  # sliding keeps blocks 4, 5 (19..24); 0..3 evictable
    kv.free("a")
    hit = kv.get_computed_blocks(hashes, 25)
    assert isinstance(hit, ComputedBlocks) and len(hit) == 6
    assert hit.groups[1][:4] == (NULL_BLOCK,) * 4 and NULL_BLOCK not in hit.groups[1][4:]
    assert NULL_BLOCK not in hit.groups[0]
    # Evict the sliding group's blocks 4 and 5 of the chain: a hit of 6 blocks is gone, a
    # hit of 4 (its window 11..16 within blocks 2, 3) still holds if those stayed cached.
    kv2 = KVCacheManager(40, 4, windows=(None, 6))
    kv2.allocate_slots("a", 24)
    kv2.cache_full_blocks("a", hashes[:4], 24)  # sliding blocks 4, 5 never registered
    kv2.free("a")
    hit = kv2.get_computed_blocks(hashes, 25)
    assert len(hit) == 4 and hit.groups[1][0] == NULL_BLOCK  # block 0 is before 16 - 6 + 1
    assert kv2.allocate_slots("b", 25, hit) is not None
    kv2.check_invariants()
    # the router's events carry group 0's hashes only
    stored, _ = kv2.take_events()
    assert set(stored) == set(hashes[:4])


def test_copy_on_write_copies_each_groups_shared_last_block():
    kv = KVCacheManager(20, 4, windows=(None, 5))
    kv.allocate_slots("p", 6)
    kv.fork("p", "c")
    assert kv.pending_copies("c") == 2
    copies = kv.copy_on_write("c")
    assert len(copies) == 2 and kv.pending_copies("c") == 0 == kv.pending_copies("p")
    kv.check_invariants()


def test_group_blocks_stop_growing_at_the_window():
    assert group_blocks((None, 512), 8192, 1, 16) == (512, 33)
    assert group_blocks((None, 512), 8192, 512, 16) == (512, 65)
    assert group_blocks((None, 512), 100, 512, 16) == (7, 7)
    kv = KVCacheManager(10_000, 16, windows=(None, 512, 512))
    assert kv.max_blocks(8192, 1) == 512 + 2 * 33 and kv.capacity(8192) == 10_000 // 578


def test_budget_capacity_is_the_pools_arithmetic():
    """``kvfleet budget``'s capacity for a Gemma 3 shape equals what a pool of its pages holds,
    and is over four times the capacity without layer groups."""
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 256, "hidden_size": 640, "sliding_window": 512,
           "sliding_window_pattern": 6, "max_position_embeddings": 32768}
    spec = spec_from_config(cfg)
    groups = pool_groups(spec)
    assert groups is not None and groups.num_groups == 6
    plan = plan_capacity(spec, memory_bytes=2 * 10**9, weights_bytes=0,
                         tokens_per_request=8192 + 16)
    kv = KVCacheManager(plan.num_blocks, 16, windows=groups.windows)
    assert plan.max_concurrent_requests == kv.capacity(8192 + 16)
    assert plan.request_bytes == request_pages(groups, 8208, 16) * plan.block_bytes
    old_block = plan.block_bytes * groups.num_groups
    old = (2 * 10**9 // old_block) // (8208 // 16 + 1)
    assert plan.max_concurrent_requests >= 4 * old


def test_replica_groups_by_window_with_or_without_the_host_tier(tiny_gemma3_dir,
                                                                tiny_llama_dir):
    from kvfleet.worker.replica.replica import ReplicaConfig, kv_layer_groups
    from kvfleet.worker.runner.model_config import load_model_config

    gemma, llama = load_model_config(tiny_gemma3_dir), load_model_config(tiny_llama_dir)
    cfg = ReplicaConfig(replica_id="r", model_name="m", model_dir=str(tiny_gemma3_dir))
    assert kv_layer_groups(cfg, gemma) == LayerGroups.from_windows(gemma.sliding_windows)
    assert kv_layer_groups(cfg, llama) == LayerGroups.single(llama.num_layers)
    tiered = ReplicaConfig(replica_id="r", model_name="m", model_dir=str(tiny_gemma3_dir),
                           kv_host_memory_bytes=1 << 20)
    assert kv_layer_groups(tiered, gemma) == kv_layer_groups(cfg, gemma)
    assert kv_layer_groups(tiered, llama).num_groups == 1


def test_layout_key_names_the_group_layout() -> None:
    """One full group is the layout without groups (""); any other layout has a key of its
    own, so KV pages of two layouts never share a tier shard or a calibration."""
    assert LayerGroups.single(6).layout_key == ""
    gemma = LayerGroups.from_windows([7, 7, None, 7, 7, None])
    mistral = LayerGroups.from_windows([7] * 6)
    other = LayerGroups.from_windows([5, 5, None, 5, 5, None])
    keys = {gemma.layout_key, mistral.layout_key, other.layout_key, ""}
    assert len(keys) == 4
    assert gemma.layout_key == LayerGroups.from_windows([7, 7, None, 7, 7, None]).layout_key


def test_the_longest_tier_hit_follows_the_per_group_rule() -> None:
    """A hit of ``m`` blocks needs a full group's blocks up to ``m`` and a sliding group's
    only those the query at ``m`` sees (window 7, blocks of 4: from block (4m - 6) // 4), after
    the ``first`` the sequence already holds. Not one leading run: a sliding group holding
    only its last blocks allows the longer hit and not the shorter one."""
    from kvfleet.allocator.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(100, 4, windows=(None, 7))
    assert kv.grouped and not KVCacheManager(100, 4).grouped

    def mask(full: str, sliding: str) -> list[bool]:
        return [c == "1" for c in full + sliding]

    assert kv.longest_hit(0, mask("11111", "00011")) == 5
    assert kv.longest_hit(0, mask("111111", "000011")) == 6  # 5 would need block 3
    assert kv.longest_hit(0, mask("111111", "000110")) == 5
    assert kv.longest_hit(0, mask("110111", "111111")) == 2  # the full group's run bounds it
    assert kv.longest_hit(0, mask("11111", "11100")) == 3
    assert kv.longest_hit(2, mask("111", "011")) == 3  # blocks 2..4; the window starts at 3
    assert kv.longest_hit(2, mask("111", "000")) == 0
    assert kv.group_keys([b"a" * 16]) == [b"a" * 16, kv.key(1, b"a" * 16)]
    with pytest.raises(ValueError, match="held mask"):
        kv.longest_hit(0, [True] * 3)
