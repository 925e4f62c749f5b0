"""API keys → tenants → cache scopes: tenants share blocks only in a declared namespace."""

import json

import pytest

from kvfleet.errors import Unauthenticated
from kvfleet.router.auth import DEFAULT_TENANT, Authenticator


def bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


def test_open_mode_is_tenant_default_with_its_own_scope():
    auth = Authenticator.from_file(None)
    assert auth.open and auth.tenant(()) == DEFAULT_TENANT
    assert auth.cache_scope(DEFAULT_TENANT) == DEFAULT_TENANT


def test_flat_key_file_and_unknown_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k-a": "acme", "k-b": "globex"}))
    auth = Authenticator.from_file(str(path))
    assert auth.tenant(bearer("k-a")) == "acme" and auth.tenant(bearer("k-b")) == "globex"
    assert auth.cache_scope("acme") == "acme" != auth.cache_scope("globex")
    for metadata in [(), bearer("nope"), (("authorization", "Basic k-a"),)]:
        with pytest.raises(Unauthenticated):
            auth.tenant(metadata)


def test_shared_namespace_gives_members_one_scope_and_outsiders_their_own(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({
        "keys": {"k-a": "acme", "k-b": "globex", "k-c": "initech"},
        "shared_namespaces": {"docs-bot": ["acme", "globex"]},
    }))
    auth = Authenticator.from_file(str(path))
    assert auth.cache_scope("acme") == auth.cache_scope("globex") == "@docs-bot"
    assert auth.cache_scope("initech") == "initech"
    assert auth.tenant(bearer("k-b")) == "globex"  # the tenant itself is unchanged


@pytest.mark.parametrize("data, message", [
    ({"k": "@docs-bot"}, "tenant name"),  # a tenant could impersonate a shared scope
    ({"k": ""}, "tenant name"),
    ({"keys": {"k": "a"}, "shared_namespaces": {"@x": ["a"]}}, "shared namespace name"),
    ({"keys": {"k": "a"}, "shared_namespaces": {"x": ["a"], "y": ["a"]}}, "two shared namespaces"),
    ({"keys": {"k": "a"}, "shared_namespaces": {"x": "a"}}, "lists of tenants"),
    ({"keys": {"k": "a"}, "extra": 1}, "unknown fields"),
    ({"k": "a/b"}, "hold no /"),  # request ids reach workers as "<tenant>/<id>"
    ({"keys": {"k": "a"}, "tenant_limits": {"a": 0}}, "tenant_limits"),
    ({"keys": {"k": "a"}, "default_tenant_share": 1.5}, "default_tenant_share"),
    (["k", "a"], "JSON object"),
])
def test_bad_key_files_are_refused_with_a_reason(tmp_path, data, message):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        Authenticator.from_file(str(path))


def test_tenant_limits_and_the_default_share_of_the_fleet(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {"k-a": "acme", "k-b": "globex"},
                                "tenant_limits": {"acme": 7}, "default_tenant_share": 0.25}))
    auth = Authenticator.from_file(str(path))
    assert auth.tenant_limit("acme", 100) == 7  # its own limit
    assert auth.tenant_limit("globex", 100) == 25  # a quarter of the fleet's capacity
    assert auth.tenant_limit("globex", 2) == 1  # never below one request
    assert auth.tenant_limit("globex", 0) is None  # capacity unknown: no limit
    assert Authenticator().tenant_limit("default", 100) is None  # default share 1: none


def test_adapter_tenants_and_admins_from_the_key_file(tmp_path):
    from kvfleet.errors import NotFound, PermissionDenied

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {"k-a": "acme", "k-b": "globex"},
                                "adapter_tenants": {"acme-sql": ["acme"]},
                                "adapter_admins": ["acme"]}))
    auth = Authenticator.from_file(str(path))
    auth.check_adapter("acme", "acme-sql")
    auth.check_adapter("globex", "open-chat")  # not listed: every tenant may use it
    with pytest.raises(NotFound, match="adapter 'acme-sql' is not served for tenant 'globex'"):
        auth.check_adapter("globex", "acme-sql")
    auth.check_adapter_admin("acme")
    with pytest.raises(PermissionDenied, match="'globex' may not load or unload adapters"):
        auth.check_adapter_admin("globex")
    Authenticator.from_file(None).check_adapter_admin(DEFAULT_TENANT)  # open router: anyone
    path.write_text(json.dumps({"keys": {"k": "t"}, "adapter_tenants": {"x": "t"}}))
    with pytest.raises(ValueError, match="adapter_tenants must map adapter names to lists"):
        Authenticator.from_file(str(path))


@pytest.mark.parametrize("data", [{}, {"keys": {}}, {"keys": {}, "adapter_admins": ["a"]}])
def test_a_named_key_file_with_no_keys_is_refused_not_open(tmp_path, data):
    # Issue 24 item 7: an empty key file used to make the router open (every caller an admin).
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no API keys"):
        Authenticator.from_file(str(path))
