"""LoRA adapters through the whole path: router (revision from the registrations, NOT_FOUND
naming an unknown adapter, ListModels) → Redis index → replicas serving ``qv`` and ``all``
(tests/fixtures/cluster.py). Greedy tokens equal transformers + peft's; cached prompt tokens
are reused only under the same adapter revision."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
import torch
from tokenizers import Tokenizer

from kvfleet.client import Client
from kvfleet.v1 import worker_pb2, worker_pb2_grpc
from tests.fixtures.adapters import peft_model
from tests.unit.worker.paged_driver import random_prompt


@pytest.fixture
def client(tiny_cluster):
    with Client(tiny_cluster.router_address) as c:
        yield c


def _adapters(client: Client) -> dict:
    """ListModels' adapters once both replicas report them."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        (model,) = client.list_models().models
        found = {a.name: a for a in model.adapters}
        if set(found) == {"qv", "all"} and all(a.replicas == 2 for a in found.values()):
            return found
        time.sleep(0.2)
    raise AssertionError(f"adapters not listed: {client.list_models()}")


def _run(client: Client, tokens: list[int], adapter: str = "", max_tokens: int = 4):
    chunks = list(client.stream(token_ids=tokens, adapter=adapter, max_tokens=max_tokens,
                                temperature=0, ignore_eos=True))
    return [t for c in chunks for t in c.token_ids], chunks[-1]


def test_list_models_lists_the_adapters_with_revisions(client) -> None:
    found = _adapters(client)
    assert len(found["qv"].revision) == 32 and found["qv"].revision != found["all"].revision


def test_unknown_adapter_is_not_found_naming_it(client) -> None:
    _adapters(client)
    with pytest.raises(grpc.RpcError) as err:
        _run(client, random_prompt(8, seed=1), adapter="no-such-lora")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-lora" in err.value.details()


def test_adapter_request_matches_peft_and_reuses_cache_only_under_it(client, tiny_llama_dir,
                                                                     tiny_adapters) -> None:
    _adapters(client)
    prompt = random_prompt(40, seed=123)
    got, first = _run(client, prompt, adapter="qv")
    ref = peft_model(tiny_llama_dir, tiny_adapters["qv"])
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, 40:]
    assert got == want.tolist()
    assert first.cached_prompt_tokens == 0
    again_tokens, again = _run(client, prompt, adapter="qv")
    assert again_tokens == got and again.cached_prompt_tokens == 32  # 2 full blocks of 16
    _, other = _run(client, prompt, adapter="all")
    _, base = _run(client, prompt)
    assert other.cached_prompt_tokens == 0 and base.cached_prompt_tokens == 0


def _wait_revision(client: Client, name: str, want) -> str:
    """The revision ListModels lists for ``name`` once ``want(revision)`` holds (None: absent)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        (model,) = client.list_models().models
        found = {a.name: a for a in model.adapters}
        rev = found[name].revision if name in found and found[name].replicas == 2 else None
        if want(rev):
            return rev
        time.sleep(0.2)
    raise AssertionError(f"adapter {name} never reached the wanted state")


def _greedy(model_dir, adapter_dir, prompt, n=4) -> list[int]:
    with torch.no_grad():
        out = peft_model(model_dir, adapter_dir).generate(torch.tensor([prompt]), max_new_tokens=n,
                                                          do_sample=False)
    return out[0, len(prompt):].tolist()


def test_runtime_load_reload_and_unload(client, tiny_llama_dir, tiny_adapters) -> None:
    """Load ``rs`` at run time, serve it, unload it; reloading ``qv`` with new weights gives a
    new revision whose requests never reuse the old revision's KV."""
    original = _adapters(client)["qv"].revision
    reply = client.load_adapter("rs", str(tiny_adapters["rs"]))
    assert len(reply.results) == 2 and all(r.revision and not r.error for r in reply.results)
    _wait_revision(client, "rs", lambda r: r is not None)
    prompt = random_prompt(20, seed=321)
    assert _run(client, prompt, adapter="rs")[0] == _greedy(tiny_llama_dir, tiny_adapters["rs"], prompt)
    client.unload_adapter("rs")
    _wait_revision(client, "rs", lambda r: r is None)
    with pytest.raises(grpc.RpcError) as err:
        _run(client, prompt, adapter="rs")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    shared = random_prompt(40, seed=322)
    _run(client, shared, adapter="qv")
    assert _run(client, shared, adapter="qv")[1].cached_prompt_tokens == 32
    client.load_adapter("qv", str(tiny_adapters["qv2"]))
    try:
        _wait_revision(client, "qv", lambda r: r not in (None, original))
        tokens, last = _run(client, shared, adapter="qv")
        assert last.cached_prompt_tokens == 0
        assert tokens == _greedy(tiny_llama_dir, tiny_adapters["qv2"], shared)
    finally:
        client.load_adapter("qv", str(tiny_adapters["qv"]))
        _wait_revision(client, "qv", lambda r: r == original)


def test_runtime_load_of_a_bad_adapter_is_refused_naming_it(client, tmp_path, tiny_adapters) -> None:
    _adapters(client)
    broken = tiny_adapters["qv"].parent / "broken"
    broken.mkdir(exist_ok=True)
    with pytest.raises(grpc.RpcError) as err:
        client.load_adapter("broken", str(broken))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter_config.json" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # outside the replicas' adapter directories
        client.load_adapter("elsewhere", str(tmp_path))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert str(tmp_path) in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.unload_adapter("never-loaded")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "never-loaded" in err.value.details()


def test_openai_http_names_an_adapter_as_the_model(tiny_cluster, client, tiny_llama_dir,
                                                    tiny_adapters) -> None:
    _adapters(client)
    base = f"http://{tiny_cluster.http_address}/v1"
    models = httpx.get(f"{base}/models").json()["data"]
    assert {m["id"]: m.get("parent") for m in models} == {"tiny-llama": None, "qv": "tiny-llama",
                                                          "all": "tiny-llama"}
    prompt = random_prompt(12, seed=55)
    body = {"model": "all", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    reply = httpx.post(f"{base}/completions", json=body, timeout=60).json()
    assert reply["model"] == "all"
    want = _greedy(tiny_llama_dir, tiny_adapters["all"], prompt)
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    assert reply["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=False)
    missing = httpx.post(f"{base}/completions", json={**body, "model": "nope"}, timeout=60)
    assert missing.status_code == 404


def _on_replica(address: str, prompt: list[int], adapter: str) -> list[int]:
    """Greedy tokens of ``prompt`` under ``adapter`` from the replica at ``address`` itself."""
    req = worker_pb2.WorkerGenerateRequest(request_id=f"direct-{address}-{adapter}",
                                           prompt_token_ids=prompt, tenant="default", adapter=adapter)
    req.sampling.max_tokens = 4
    req.sampling.temperature = 0
    req.sampling.ignore_eos = True
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return [t for m in stub.Generate(req, timeout=60) for t in m.token_ids]


def _wait_listed(client: Client, want: dict[str, int]) -> None:
    """Wait until ListModels lists exactly the adapters ``want`` names, each on that many
    replicas."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (model,) = client.list_models().models
        if {a.name: a.replicas for a in model.adapters} == want:
            return
        time.sleep(0.2)
    raise AssertionError(f"adapters never became {want}: {client.list_models()}")


def test_runtime_adapter_changes_reach_replicas_serve_starts_later(tiny_cluster, client, tiny_llama_dir,
                                                                    tiny_adapters) -> None:
    """Issue 24 item 16 through Ray Serve: ``rs`` loaded at run time on 1 replica is served by
    the one a scale 1 → 2 adds; once unloaded, a replica Serve starts later (2 → 1 → 2) lacks it.
    Leaves the module's fleet as it found it: 2 replicas serving ``qv`` and ``all``."""
    start_time = {"qv": 2, "all": 2}
    prompt = random_prompt(20, seed=4242)
    want = _greedy(tiny_llama_dir, tiny_adapters["rs"], prompt)
    try:
        (kept,) = tiny_cluster.scale(1)
        _wait_listed(client, {"qv": 1, "all": 1})  # the router no longer counts the one gone
        reply = client.load_adapter("rs", str(tiny_adapters["rs"]))
        assert [r.replica_id for r in reply.results] == [kept.replica_id]
        assert reply.results[0].revision and not reply.results[0].error

        (added,) = [i for i in tiny_cluster.scale(2) if i.replica_id != kept.replica_id]
        _wait_listed(client, {**start_time, "rs": 2})
        assert _on_replica(added.address, prompt, "rs") == want
        assert _run(client, prompt, adapter="rs")[0] == want

        client.unload_adapter("rs")
        _wait_listed(client, start_time)
        before = {i.replica_id for i in tiny_cluster.scale(1)}
        (fresh,) = [i for i in tiny_cluster.scale(2) if i.replica_id not in before]
        _wait_listed(client, start_time)
        with pytest.raises(grpc.RpcError) as err:
            _on_replica(fresh.address, prompt, "rs")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "rs" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            _run(client, prompt, adapter="rs")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert _on_replica(fresh.address, prompt, "qv") == _greedy(tiny_llama_dir, tiny_adapters["qv"],
                                                                   prompt)
    finally:
        tiny_cluster.scale(2)
        (model,) = client.list_models().models
        if "rs" in {a.name for a in model.adapters}:  # the test failed before unloading it
            client.unload_adapter("rs")
