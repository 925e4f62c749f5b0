"""KV-cache bookkeeping shared by the router and the worker (pure Python, no torch)."""
