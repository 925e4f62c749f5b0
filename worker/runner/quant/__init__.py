"""Weight-only quantized projections: packing, the C kernels' binding and the weight sources."""
