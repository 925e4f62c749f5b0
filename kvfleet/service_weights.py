"""What one computed token is worth to a tenant's *service* account, on both sides: a
replica's scheduler picks the least-served tenant with it (kvfleet.worker.engine.scheduling.tenant_service)
and the router sums each finished request's service into the fleet's per-tenant account
(kvfleet.router.tenant_limits)::

    service = PREFILL_WEIGHT × uncached prompt tokens + DECODE_WEIGHT × output tokens

Tokens served from the prefix cache are free. A decode token weighs more than a prefill token:
it costs a whole batch row for one token (VTC's choice, Sheng et al., OSDI '24; the measured
ratio on CPU and GPU: docs/design.md §10).
"""

PREFILL_WEIGHT = 1.0  # service per prefill token computed (not per cached token)
DECODE_WEIGHT = 2.0   # service per decode token
