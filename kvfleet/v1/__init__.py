"""Generated gRPC stubs of the kvfleet.v1 contract (source of truth: proto/kvfleet/v1/).

Regenerate with ``python proto/generate.py``; do not edit the ``*_pb2*`` files by hand.
"""
