"""A do-nothing relay: ``Router.Generate`` with token ids → one ``Worker.Generate`` call → relay.

``bench.cluster.router_cost`` measures it next to the router as the floor of a Python gRPC hop on
the machine at hand: no auth, validation, hashing, index lookup or scoring, one process.

    python -m bench.cluster.null_relay WORKER_HOST:PORT    # prints "ready HOST:PORT", serves until killed
"""

from __future__ import annotations

import asyncio
import sys
import uuid

import grpc

from kvfleet.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS, bind_port
from kvfleet.v1 import router_pb2, worker_pb2


async def serve(worker_address: str) -> None:
    channel = grpc.aio.insecure_channel(worker_address, options=CHANNEL_OPTIONS)
    # The worker's GenerateResponse messages pass as bytes: not even parsed.
    call_worker = channel.unary_stream(
        "/kvfleet.v1.Worker/Generate",
        request_serializer=worker_pb2.WorkerGenerateRequest.SerializeToString,
        response_deserializer=None)

    async def generate(request: router_pb2.GenerateRequest, context):
        req = worker_pb2.WorkerGenerateRequest(request_id=uuid.uuid4().hex, tenant="default",
                                               prompt_token_ids=request.token_ids.ids)
        req.sampling.CopyFrom(request.sampling)
        async for raw in call_worker(req):
            yield raw

    handler = grpc.method_handlers_generic_handler("kvfleet.v1.Router", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=router_pb2.GenerateRequest.FromString,
            response_serializer=None)})
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = bind_port(server, "127.0.0.1", 0)
    await server.start()
    print(f"ready 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
