"""The KServe v2 inference protocol: its routes, binary tensor data, and request parsing."""
