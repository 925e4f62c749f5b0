"""The read side of host-tier residency in the prefix index (layout: :mod:`kvfleet.index_keys`,
"Host tier"), shared by the three :class:`~kvfleet.router.prefix_index.PrefixIndex`
implementations.

A replica whose registry entry names a node tier (``ReplicaInfo.kv_tier``) restores, at
admission, the chain's blocks after its device prefix that the tier holds (up to the first one
it lacks). :func:`count_host` counts exactly those, per replica, from the tiers' held sets;
:data:`HOST_MATCH_LUA` does the same inside Redis in one round trip.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kvfleet.allocator.hashing import HASH_BYTES
from kvfleet.index_keys import IndexKeys

# replica_id -> (its node tier's id, leading blocks of the chain it holds on device)
HostStarts = Mapping[str, tuple[str, int]]
TierSets = dict[str, tuple[int, set[bytes]]]  # tier_id -> (epoch, held block hashes)


def count_host(chain: Sequence[bytes], starts: HostStarts, tiers: TierSets) -> dict[str, int]:
    """Per replica of ``starts``, the blocks of ``chain`` after its device prefix that its
    tier holds, up to the first miss; replicas with none are left out."""
    out: dict[str, int] = {}
    counted: dict[tuple[str, int], int] = {}  # replicas of one node mostly share a start
    for rid, key in starts.items():
        if key not in counted:
            counted[key] = _run_length(chain, key[1], tiers.get(key[0]))
        if counted[key]:
            out[rid] = counted[key]
    return out


def _run_length(chain: Sequence[bytes], start: int,
                entry: tuple[int, set[bytes]] | None) -> int:
    if entry is None:
        return 0
    held, k = entry[1], start
    while k < len(chain) and chain[k] in held:
        k += 1
    return k - start


def apply_tier_event(tiers: TierSets, kind: bytes, tier: str, epoch: int,
                     removed: Sequence[bytes], stored: Sequence[bytes]) -> None:
    """One ``treg`` / ``tblk`` log entry: a new epoch starts empty; an older one is ignored."""
    entry = tiers.get(tier)
    if entry is not None and epoch < entry[0]:
        return
    if entry is None or epoch > entry[0] or kind == b"treg":
        entry = tiers[tier] = (epoch, set())
    entry[1].difference_update(removed)
    entry[1].update(stored)


async def snapshot_tiers(redis: Any, keys: IndexKeys) -> TierSets:
    """Every registered tier's held set at its current epoch (``redis``: a binary client)."""
    out: TierSets = {}
    for raw in await redis.hkeys(keys.tier_epochs):
        tier = raw.decode()
        async with redis.pipeline(transaction=True) as pipe:  # epoch and set agree
            epoch, entries = await pipe.hget(keys.tier_epochs, tier) \
                .hgetall(keys.tier_held(tier)).execute()
        if epoch is not None:
            out[tier] = (int(epoch), {h for h, e in entries.items()
                                      if e == epoch and len(h) == HASH_BYTES})
    return out


async def expired_tiers(redis: Any, keys: IndexKeys, tiers: Sequence[str]) -> list[str]:
    """Those of ``tiers`` whose held entries Redis no longer has (their TTL ran out: the tier
    stopped heartbeating), in one round trip (``redis``: an async client)."""
    if not tiers:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for tier in tiers:
            pipe.exists(keys.tier_held(tier))
        found = await pipe.execute()
    return [tier for tier, n in zip(tiers, found, strict=True) if not n]


def host_match_args(keys: IndexKeys, chain: bytes, starts: HostStarts) -> tuple[list, list]:
    """KEYS and ARGV of :data:`HOST_MATCH_LUA` (``chain``: the packed chain)."""
    args: list = [keys.tier_held(""), chain]
    for rid, (tier, start) in starts.items():
        args += [rid, tier, start]
    return [keys.tier_epochs], args


HOST_MATCH_LUA = """
-- KEYS[1] tier epochs; ARGV[1] tier held key prefix, ARGV[2] the chain (hashes concatenated,
-- %(w)d bytes each), then (replica_id, tier_id, device blocks) triples.
-- Returns {replica_id, host blocks, ...} for the replicas with at least one.
local chain = ARGV[2]
local n = #chain / %(w)d
local out = {}
for i = 3, #ARGV, 3 do
  local rid, tier, start = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local epoch = redis.call('HGET', KEYS[1], tier)
  local count = 0
  while epoch and start + count < n do
    local first, last = start + count + 1, math.min(n, start + count + %(step)d)
    local blocks = {}
    for b = first, last do
      blocks[#blocks + 1] = string.sub(chain, %(w)d * (b - 1) + 1, %(w)d * b)
    end
    local held = redis.call('HMGET', ARGV[1] .. tier, unpack(blocks))
    local k = 0
    while k < #blocks and held[k + 1] == epoch do k = k + 1 end
    count = count + k
    if k < #blocks then break end
  end
  if count > 0 then out[#out + 1] = rid; out[#out + 1] = count end
end
return out
""" % {"w": HASH_BYTES, "step": 1024}


class InMemoryTierPublisher:
    """A node tier's writer into an in-memory index's ``tiers`` (tests): pass :meth:`record`
    as a :class:`~kvfleet.worker.kv_tier.store.HostTierStore` listener. Registers a new epoch
    when built, like a restarted tier."""

    def __init__(self, tiers: TierSets, tier_id: str) -> None:
        self._tiers, self.tier_id = tiers, tier_id
        self.epoch = tiers.get(tier_id, (0, set()))[0] + 1
        tiers[tier_id] = (self.epoch, set())

    def record(self, changes: list[tuple[bytes, bool]]) -> None:
        """``(hash, held now)`` in order, applied at once."""
        held = self._tiers[self.tier_id][1]
        for h, now_held in changes:
            if now_held:
                held.add(h)
            else:
                held.discard(h)
