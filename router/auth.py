"""API key → tenant, and tenant → cache scope. With no key file the router runs open and every
request is tenant ``default``; a key file that is named must hold at least one key (it never
opens the router, at start or on reload).

Clients send ``authorization: Bearer <api key>`` metadata; the tenant never comes from a request
field. The key file is JSON, either a flat ``{"<api key>": "<tenant>", ...}`` or::

    {"keys": {"<api key>": "<tenant>", ...},
     "shared_namespaces": {"<name>": ["<tenant>", "<tenant>", ...], ...}}

The object form may also hold per-tenant limits on in-flight requests (per router):
``"tenant_limits": {"<tenant>": <requests>, ...}`` and ``"default_tenant_share": <fraction>``,
the fraction of the fleet's advertised capacity any other tenant may hold (default 1.0).

LoRA adapters: ``"adapter_tenants": {"<adapter>": ["<tenant>", ...], ...}`` limits an adapter
to the tenants listed (any other tenant gets NOT_FOUND for it, as for an adapter not served;
adapters not listed are open to every tenant), and ``"adapter_admins": ["<tenant>", ...]``
names the tenants that may load and unload adapters at run time (with a key file, nobody else
may; an open router lets anyone). Adapter listings (``ListModels``, ``/v1/models``) show a
tenant only the adapters it may use.

Priority: a key's value may be an object instead of the tenant's name,
``{"tenant": "<tenant>", "priority": "batch"}``: requests with that key that set no
``priority`` of their own get that class (or number, see :mod:`kvfleet.priority`); other keys'
class is ``default``. A key's class is also a ceiling: a request may lower its priority, never
raise it above its key's (PERMISSION_DENIED naming the field). A bad class fails the whole file
(the router keeps its previous keys).

Cluster admins: ``"admins": ["<tenant>", ...]`` may call ``Router.ClusterStatus`` (replica
addresses, pids, the Redis host); with a key file nobody else may.

Tenants never share KV blocks (prefix reuse across tenants is a timing side channel) unless the
operator lists them in one shared namespace. The *cache scope* is what the block-hash root is
keyed by (``root = H(identity, scope, cache_salt)``) and what the router sends the worker as
``cache_scope`` (next to the ``tenant`` itself, which the worker's fair admission counts): the
tenant's own name, or ``@<name>`` for a member of shared namespace ``<name>``.
Tenant names may not start with ``@``, so no tenant can collide with a shared scope, nor hold a
``/`` (request ids reach workers as ``<tenant>/<request_id>``).
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Optional, Sequence

from kvfleet import priority
from kvfleet.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated

DEFAULT_TENANT = "default"
_OBJECT_FIELDS = {"keys", "shared_namespaces", "tenant_limits", "default_tenant_share",
                  "adapter_tenants", "adapter_admins", "admins"}
SHARED_SCOPE_PREFIX = "@"


class Authenticator:
    """``keys``: API key → tenant; ``shared_namespaces``: namespace name → member tenants.

    Raises ValueError for a tenant or namespace name that is empty or starts with ``@``, or a
    tenant listed in two shared namespaces.
    """

    def __init__(self, keys: Optional[dict[str, str]] = None,
                 shared_namespaces: Optional[dict[str, Sequence[str]]] = None,
                 tenant_limits: Optional[dict[str, int]] = None,
                 default_tenant_share: float = 1.0,
                 adapter_tenants: Optional[dict[str, Sequence[str]]] = None,
                 adapter_admins: Sequence[str] = (), admins: Sequence[str] = (),
                 key_priorities: Optional[dict[str, int]] = None) -> None:
        self._keys = dict(keys or {})
        # API key → its priority class (kvfleet.priority); keys not listed: default.
        self._key_priorities = dict(key_priorities or {})
        if set(self._key_priorities) - set(self._keys):
            raise ValueError("key_priorities names keys that are not in keys")
        self.adapter_tenants = {a: frozenset(ts) for a, ts in (adapter_tenants or {}).items()}
        self.adapter_admins = frozenset(adapter_admins)
        self.admins = frozenset(admins)
        for tenant in (*self.adapter_admins, *self.admins,
                       *(t for ts in self.adapter_tenants.values() for t in ts)):
            _check_name(tenant, "tenant")
        self._scope: dict[str, str] = {}
        self.tenant_limits = dict(tenant_limits or {})
        self.default_tenant_share = default_tenant_share
        if not all(isinstance(v, int) and v > 0 for v in self.tenant_limits.values()):
            raise ValueError("tenant_limits must map tenants to request counts > 0")
        if not (isinstance(default_tenant_share, (int, float)) and 0 < default_tenant_share <= 1):
            raise ValueError(f"default_tenant_share must be in (0, 1], got {default_tenant_share!r}")
        for tenant in self._keys.values():
            _check_name(tenant, "tenant")
        for name, members in (shared_namespaces or {}).items():
            _check_name(name, "shared namespace")
            for tenant in members:
                _check_name(tenant, "tenant")
                if tenant in self._scope:
                    raise ValueError(f"tenant {tenant!r} is in two shared namespaces "
                                     f"({self._scope[tenant][1:]!r} and {name!r})")
                self._scope[tenant] = SHARED_SCOPE_PREFIX + name

    @classmethod
    def from_file(cls, path: Optional[str]) -> "Authenticator":
        """The authenticator of a key file (``None``/empty path: an open router).

        Raises ValueError if the file is not one of the two documented JSON shapes, or holds
        no API key (a named file never opens the router)."""
        if not path:
            return cls()
        data = json.loads(Path(path).read_text())
        shared: dict = {}
        limits: dict = {}
        share = 1.0
        adapters: dict = {}
        admins: list = []
        cluster_admins: list = []
        if isinstance(data, dict) and isinstance(data.get("keys"), dict):
            keys, shared = data["keys"], data.get("shared_namespaces") or {}
            adapters, admins = data.get("adapter_tenants") or {}, data.get("adapter_admins") or []
            cluster_admins = data.get("admins") or []
            limits = data.get("tenant_limits") or {}
            share = data.get("default_tenant_share", 1.0)
            if set(data) - _OBJECT_FIELDS:
                raise ValueError(f"{path}: unknown fields {sorted(set(data) - _OBJECT_FIELDS)}")
        else:
            keys = data
        if not isinstance(keys, dict):
            raise ValueError(f"{path}: expected a JSON object mapping API keys to tenant names")
        keys, key_priorities = _split_key_entries(keys, path)
        if not keys:  # fail closed: a named file that holds no key must not open the router
            raise ValueError(f"{path}: no API keys (a key file must hold at least one; run "
                             f"without --api-keys for an open router)")
        if not isinstance(shared, dict) or not all(
                isinstance(v, list) and all(isinstance(t, str) for t in v) for v in shared.values()):
            raise ValueError(f"{path}: shared_namespaces must map names to lists of tenants")
        if not isinstance(adapters, dict) or not all(
                isinstance(v, list) and all(isinstance(t, str) for t in v) for v in adapters.values()):
            raise ValueError(f"{path}: adapter_tenants must map adapter names to lists of tenants")
        for field_name, names in (("adapter_admins", admins), ("admins", cluster_admins)):
            if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
                raise ValueError(f"{path}: {field_name} must be a list of tenants")
        try:
            return cls(keys, shared, limits, share, adapters, admins, cluster_admins,
                       key_priorities)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @property
    def open(self) -> bool:
        return not self._keys

    def tenant(self, metadata: Sequence[tuple[str, str]]) -> str:
        """The tenant for a request's metadata. Raises Unauthenticated."""
        if self.open:
            return DEFAULT_TENANT
        return self._keys[self._api_key(metadata)]

    def key_class(self, metadata: Sequence[tuple[str, str]]) -> Optional[int]:
        """The priority class of the request's API key: its requests' default and the highest
        priority they may ask for (:func:`kvfleet.priority.within_key`); ``default`` for a key
        that names none, None for an open router. Raises Unauthenticated, as :meth:`tenant`
        does."""
        if self.open:
            return None
        return self._key_priorities.get(self._api_key(metadata), priority.DEFAULT)

    def _api_key(self, metadata: Sequence[tuple[str, str]]) -> str:
        """The known API key the metadata carries. Raises Unauthenticated."""
        auth = dict(metadata or ()).get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated("missing 'authorization: Bearer <api key>' metadata")
        for known in self._keys:
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return known
        raise Unauthenticated("unknown API key")

    def tenant_limit(self, tenant: str, fleet_capacity: int) -> Optional[int]:
        """In-flight requests ``tenant`` may hold on this router: its own limit, else the
        default share of ``fleet_capacity`` (0 = unknown: no limit)."""
        if tenant in self.tenant_limits:
            return self.tenant_limits[tenant]
        if self.default_tenant_share >= 1 or fleet_capacity <= 0:
            return None
        return max(1, int(self.default_tenant_share * fleet_capacity))

    def check_adapter(self, tenant: str, adapter: str) -> None:
        """Raises NotFound (naming the adapter) when ``adapter`` is limited to other tenants."""
        if not self.may_use_adapter(tenant, adapter):
            raise NotFound(f"adapter {adapter!r} is not served for tenant {tenant!r}",
                           field="adapter")

    def may_use_adapter(self, tenant: str, adapter: str) -> bool:
        """Whether ``tenant`` may use (and see listed) ``adapter``."""
        allowed = self.adapter_tenants.get(adapter)
        return allowed is None or tenant in allowed

    def check_admin(self, tenant: str) -> None:
        """Raises PermissionDenied unless the router is open or ``tenant`` is a cluster admin
        (the key file's ``admins``)."""
        if not self.open and tenant not in self.admins:
            raise PermissionDenied(f"tenant {tenant!r} may not read the cluster status "
                                   f"(the key file's admins)")

    def check_adapter_admin(self, tenant: str) -> None:
        """Raises PermissionDenied unless the router is open or ``tenant`` is an adapter admin."""
        if not self.open and tenant not in self.adapter_admins:
            raise PermissionDenied(f"tenant {tenant!r} may not load or unload adapters "
                                   f"(the key file's adapter_admins)")

    def cache_scope(self, tenant: str) -> str:
        """The scope a tenant's KV blocks are keyed by: itself, or ``@<shared namespace>``."""
        return self._scope.get(tenant, tenant)


def _split_key_entries(entries: dict, path: str) -> tuple[dict[str, str], dict[str, int]]:
    """A key file's ``keys`` → (API key → tenant, API key → default priority). A value is a
    tenant name or ``{"tenant": ..., "priority": ...}``. Raises ValueError naming the field
    and the tenant (never the key: it is a secret)."""
    keys: dict[str, str] = {}
    priorities: dict[str, int] = {}
    for key, value in entries.items():
        if isinstance(value, dict):
            tenant = value.get("tenant")
            if not isinstance(key, str) or not isinstance(tenant, str) or set(value) - {
                    "tenant", "priority"}:
                raise ValueError(f"{path}: keys: an object value needs a string 'tenant' and "
                                 f"may hold only 'priority' besides, got fields {sorted(value)}")
            if "priority" in value:
                try:
                    priorities[key] = priority.parse(value["priority"], "priority")
                except InvalidArgument as exc:
                    raise ValueError(f"{path}: keys: the priority of a key of tenant "
                                     f"{tenant!r}: {exc}") from None
            value = tenant
        if not (isinstance(key, str) and isinstance(value, str)):
            raise ValueError(f"{path}: expected a JSON object mapping API keys to tenant names")
        keys[key] = value
    return keys, priorities


def _check_name(name: str, kind: str) -> None:
    # No "/" in a tenant: the router namespaces request ids as "<tenant>/<request_id>".
    if (not isinstance(name, str) or not name or name.startswith(SHARED_SCOPE_PREFIX)
            or (kind == "tenant" and "/" in name)):
        raise ValueError(f"{kind} name must be non-empty, not start with "
                         f"{SHARED_SCOPE_PREFIX!r}{' and hold no /' if kind == 'tenant' else ''}"
                         f", got {name!r}")
