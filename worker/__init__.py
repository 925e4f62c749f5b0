"""A model replica: gRPC server → engine loop → scheduler → model runner → stream."""
