"""Every span, event, attribute, metric and metadata name kvfleet's telemetry uses, defined once.

``gen_ai.*``, ``rpc.*``, ``server.*`` and ``error.type`` follow the OpenTelemetry semantic
conventions (GenAI, RPC); ``kvfleet.*`` names are ours. Code elsewhere imports these constants
and never spells a name itself.
"""

from __future__ import annotations

# ---- spans (docs/design.md §6): router.Generate ⊃ tokenize, route, dispatch ⊃ worker.Generate ⊃ phases
CLIENT_GENERATE = "client.Generate"
ROUTER_GENERATE = "router.Generate"
ROUTER_TOKENIZE = "router.tokenize"
ROUTER_ROUTE = "router.route"
ROUTER_DISPATCH = "router.dispatch"
WORKER_GENERATE = "worker.Generate"
WORKER_QUEUE = "worker.queue"
WORKER_PREFILL = "worker.prefill"
WORKER_DECODE = "worker.decode"

# ---- span events (token timing goes into events and histograms, never per-token spans)
EVENT_PREFILL_CHUNK = "kvfleet.prefill.chunk"
EVENT_FIRST_TOKEN = "kvfleet.first_token"

# ---- GenAI semantic-convention attributes
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"

PROVIDER = "kvfleet"          # value of gen_ai.provider.name
OPERATION_CHAT = "chat"       # gen_ai.operation.name for `messages` prompts
OPERATION_TEXT = "text_completion"  # … for `text` and `token_ids` prompts

# ---- RPC / general semantic-convention attributes
RPC_SYSTEM = "rpc.system"
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
SERVER_ADDRESS = "server.address"
HTTP_REQUEST_METHOD = "http.request.method"  # the HTTP front's server span
HTTP_ROUTE = "http.route"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
USER_ID = "user.id"  # an OpenAI request's `user` field
ERROR_TYPE = "error.type"
SERVICE_NAME = "service.name"
SERVICE_INSTANCE_ID = "service.instance.id"
PROCESS_PID = "process.pid"

# ---- kvfleet attributes
KVFLEET_COMPONENT = "kvfleet.component"            # router | worker | client (resource)
KVFLEET_REQUEST_ID = "kvfleet.request.id"
KVFLEET_TENANT = "kvfleet.tenant"
KVFLEET_REPLICA_ID = "kvfleet.replica.id"
# The request's priority (kvfleet.priority): its number on spans, and its class as a metric
# label (interactive | default | batch | other: bounded).
KVFLEET_PRIORITY = "kvfleet.request.priority"
KVFLEET_PRIORITY_CLASS = "kvfleet.request.priority_class"
# The request's LoRA adapter (gen_ai.request.model stays the base model). As a metric label
# only for adapters the process was configured with: the label's values stay bounded.
KVFLEET_ADAPTER = "kvfleet.lora.adapter"
KVFLEET_ROUTE_POLICY = "kvfleet.route.policy"
KVFLEET_ROUTE_PROMPT_BLOCKS = "kvfleet.route.prompt_blocks"    # full blocks hashed
KVFLEET_ROUTE_MATCHED_BLOCKS = "kvfleet.route.matched_blocks"  # index's match on the choice
KVFLEET_ROUTE_HOST_BLOCKS = "kvfleet.route.host_blocks"  # … and its node host tier's after it
KVFLEET_ROUTE_REDIS_S = "kvfleet.route.redis_s"          # the index lookup (≈0 from the mirror)
KVFLEET_ROUTE_INDEX_USED = "kvfleet.route.index_used"  # false: Redis down or not consulted
KVFLEET_ROUTE_INDEX_SOURCE = "kvfleet.route.index_source"  # mirror | redis | "" (not consulted)
# one string per replica considered: "<id> matched=<blocks> load=<requests> (reported=R settled=S inflight=I)"
KVFLEET_ROUTE_CANDIDATES = "kvfleet.route.candidates"
KVFLEET_CACHED_PROMPT_TOKENS = "kvfleet.usage.cached_prompt_tokens"  # what the worker reused
KVFLEET_PREFILL_CHUNKS = "kvfleet.prefill.chunks"
KVFLEET_CHUNK_TOKENS = "kvfleet.prefill.chunk.tokens"
KVFLEET_NETWORK_S = "kvfleet.network_s"            # router.dispatch − worker.Generate
KVFLEET_WORKER_S = "kvfleet.worker.duration_s"     # worker.Generate as the worker measured it
KVFLEET_TTFT_S = "kvfleet.ttft_s"                  # worker-measured time to first token
KVFLEET_TPOT_S = "kvfleet.time_per_output_token_s"
KVFLEET_SPEC_DRAFTED = "kvfleet.speculative.drafted_tokens"    # drafts verified (decode span)
KVFLEET_SPEC_ACCEPTED = "kvfleet.speculative.accepted_tokens"  # … of them accepted
KVFLEET_CLIENT_TTFT_S = "kvfleet.client.ttft_s"    # client-observed time to first token
KVFLEET_REQUEST_STATE = "kvfleet.request.state"    # running | waiting (gauge attribute)
KVFLEET_KV_TIER = "kvfleet.kv.tier"                # device | host: where a prefix hit came from
KVFLEET_STEP_SIDE = "kvfleet.step.side"            # decode | prefill: a step-cost correction
KVFLEET_PREEMPT_REASON = "kvfleet.preemption.reason"  # blocks | class | tenant_seat

# ---- finish reasons (gen_ai.response.finish_reasons values)
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_DEADLINE = "deadline"
FINISH_ERROR = "error"

# ---- metrics (units: seconds "s", tokens "{token}", requests "{request}", ratio "1")
GEN_AI_SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
GEN_AI_SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"
GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK = "gen_ai.client.operation.time_to_first_chunk"
GEN_AI_CLIENT_OPERATION_DURATION = "gen_ai.client.operation.duration"
METRIC_WORKER_REQUEST_DURATION = "kvfleet.worker.request.duration"
METRIC_QUEUE_DURATION = "kvfleet.worker.queue.duration"
METRIC_PREFILL_DURATION = "kvfleet.worker.prefill.duration"
METRIC_DECODE_DURATION = "kvfleet.worker.decode.duration"
METRIC_PROMPT_TOKENS = "kvfleet.worker.prompt_tokens"
METRIC_PREFIX_HIT_TOKENS = "kvfleet.worker.prefix_cache.hit_tokens"
METRIC_OUTPUT_TOKENS = "kvfleet.worker.output_tokens"
METRIC_KV_CACHE_USAGE = "kvfleet.worker.kv_cache.usage"
METRIC_REQUESTS = "kvfleet.worker.requests"
# The step-cost model against the forwards it predicted (rate(measured) ÷ rate(predicted): drift).
METRIC_STEP_PREDICTED = "kvfleet.worker.step.predicted_time"
METRIC_STEP_MEASURED = "kvfleet.worker.step.measured_time"
METRIC_STEPS = "kvfleet.worker.steps"
METRIC_NESTED_STEPS = "kvfleet.worker.nested_steps"
# Sequences preempted by recompute, by reason (Prometheus: kvfleet_worker_preemptions_total).
METRIC_PREEMPTIONS = "kvfleet.worker.preemptions"
# Forward seconds charged to each priority class's rows (the requests' replica_s, summed by
# class as the steps run; Prometheus: kvfleet_worker_replica_time_seconds_total).
METRIC_REPLICA_TIME = "kvfleet.worker.replica_time"
# Speculative decoding: drafted / accepted tokens (per request at its finish, summed), and the
# acceptance (accepted ÷ drafted) of each request that drafted.
METRIC_SPEC_DRAFTED = "kvfleet.worker.speculative.drafted_tokens"
METRIC_SPEC_ACCEPTED = "kvfleet.worker.speculative.accepted_tokens"
METRIC_SPEC_ACCEPTANCE = "kvfleet.worker.speculative.acceptance"
SPEC_ACCEPTANCE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
METRIC_STEP_COST_SCALE = "kvfleet.worker.step.cost_scale"
METRIC_TENANT_SERVICE = "kvfleet.worker.tenant.service"  # weighted tokens computed per tenant
METRIC_QUEUE_DELAY = "kvfleet.worker.queue_delay"  # predicted (the load report's queue_delay_s)
# The host KV tier (kvfleet.telemetry.tier_metrics): blocks moved, bytes held, hits by tier.
METRIC_TIER_BYTES_USED = "kvfleet.worker.kv_tier.bytes_used"
METRIC_TIER_CAPACITY = "kvfleet.worker.kv_tier.capacity"
METRIC_TIER_WRITE_BACKS = "kvfleet.worker.kv_tier.write_backs"
METRIC_TIER_DROPPED_WRITE_BACKS = "kvfleet.worker.kv_tier.dropped_write_backs"
METRIC_TIER_RESTORES = "kvfleet.worker.kv_tier.restores"
METRIC_TIER_FAILED_RESTORES = "kvfleet.worker.kv_tier.failed_restores"
METRIC_TIER_BYTES_WRITTEN = "kvfleet.worker.kv_tier.bytes_written"
METRIC_TIER_BYTES_RESTORED = "kvfleet.worker.kv_tier.bytes_restored"
METRIC_PREFIX_HIT_TOKENS_BY_TIER = "kvfleet.worker.prefix_cache.tier_hit_tokens"
METRIC_PREFIX_HIT_RATE_BY_TIER = "kvfleet.worker.prefix_cache.tier_hit_rate"
# Peer pulls (docs/kv_tier.md, kvfleet.telemetry.tier_metrics): the receiving replica's PullStats.
METRIC_PEER_PULLS = "kvfleet.worker.kv_peer.pulls"
METRIC_PEER_PULLED_BLOCKS = "kvfleet.worker.kv_peer.pulled_blocks"
METRIC_PEER_PULL_TIME = "kvfleet.worker.kv_peer.pull_time"
METRIC_PEER_PULLS_SKIPPED = "kvfleet.worker.kv_peer.skipped"
METRIC_PEER_PULLS_REFUSED = "kvfleet.worker.kv_peer.refused"
METRIC_PEER_PULLS_FAILED = "kvfleet.worker.kv_peer.failed"
METRIC_PEER_PULLS_TIMED_OUT = "kvfleet.worker.kv_peer.timed_out"
METRIC_PEER_PULLS_EMPTY = "kvfleet.worker.kv_peer.empty"
METRIC_NETWORK_DURATION = "kvfleet.router.network.duration"
METRIC_ROUTE_DURATION = "kvfleet.router.route.duration"

# Bucket boundaries (seconds), as the GenAI conventions advise for these histograms.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                      40.96, 81.92)
NETWORK_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0)

# ---- gRPC metadata (lower case, as gRPC requires)
MD_WORKER_DURATION_S = "kvfleet-worker-duration-s"  # worker → router → client trailer
MD_NETWORK_S = "kvfleet-network-s"                  # router → client trailer
MD_TRACE_ID = "kvfleet-trace-id"                    # router → client trailer (when traced)
