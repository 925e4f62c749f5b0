"""Every part of a block's identity changes its chain: no hit across tenants, salts, adapters,
adapter revisions, model revisions, KV dtypes or block sizes (docs/design.md §2)."""

from __future__ import annotations

import shutil
from dataclasses import replace

from safetensors.torch import load_file, save_file

from kvfleet.allocator.fingerprint import fingerprint_model_dir
from kvfleet.allocator.hashing import CacheIdentity, block_hash_chain, root_hash

BASE = CacheIdentity(model="m", weights_fingerprint="w1", tokenizer_fingerprint="t",
                     chat_template_fingerprint="c", kv_dtype="float32", block_size=16)
TOKENS = list(range(1000, 1064))


def chain(identity: CacheIdentity = BASE, scope: str = "acme", salt: str = "") -> list[bytes]:
    return block_hash_chain(root_hash(identity.digest(), scope, salt), TOKENS, 16)


def test_each_identity_component_gives_a_disjoint_chain():
    variants = {
        "base": chain(),
        "tenant": chain(scope="globex"),
        "shared namespace": chain(scope="@team"),
        "salt": chain(salt="s"),
        "adapter": chain(BASE.with_adapter("sql-lora", "r1")),
        "adapter revision": chain(BASE.with_adapter("sql-lora", "r2")),
        "model revision": chain(replace(BASE, weights_fingerprint="w2")),
        "tokenizer": chain(replace(BASE, tokenizer_fingerprint="t2")),
        "chat template": chain(replace(BASE, chat_template_fingerprint="c2")),
        "kv dtype": chain(replace(BASE, kv_dtype="bfloat16")),
        "model name": chain(replace(BASE, model="m2")),
    }
    seen: dict[bytes, str] = {}
    for name, blocks in variants.items():
        for h in blocks:
            assert h not in seen, f"{name} shares a block with {seen.get(h)}"
            seen[h] = name


def test_tags_keep_an_adapter_named_x_apart_from_a_salt_x():
    assert chain(BASE.with_adapter("x")) != chain(salt="x")
    assert root_hash(BASE.digest(), "ab", "") != root_hash(BASE.digest(), "a", "b")


def test_a_fine_tuned_revision_with_the_same_shapes_gets_another_fingerprint(tiny_llama_dir,
                                                                            tmp_path):
    revised = tmp_path / "revised"
    shutil.copytree(tiny_llama_dir, revised)
    weights = load_file(revised / "model.safetensors")
    name = sorted(weights)[len(weights) // 2]  # one small tensor changes, shapes do not
    weights[name] = weights[name] * 1.01
    save_file(weights, revised / "model.safetensors", metadata={"format": "pt"})
    a, b = fingerprint_model_dir(tiny_llama_dir), fingerprint_model_dir(revised)
    assert a.weights != b.weights
    assert (a.tokenizer, a.chat_template) == (b.tokenizer, b.chat_template)
    assert fingerprint_model_dir(tiny_llama_dir) == a  # deterministic


def test_the_router_s_memoised_root_is_the_allocator_s_root(tiny_llama_dir):
    from kvfleet.router.served_model import ServedModel

    model = ServedModel.load("tiny", tiny_llama_dir, block_size=16)
    for scope, salt in [("default", ""), ("acme", ""), ("acme", "s1"), ("default", "")]:
        assert model.root_hash(scope, salt) == root_hash(model.identity.digest(), scope, salt)
    assert len({model.root_hash("acme", ""), model.root_hash("acme", "s1"),
                model.root_hash("default", "")}) == 3
