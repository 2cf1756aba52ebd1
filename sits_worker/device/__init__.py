"""The device a worker is pinned to: NVML, CUDA visibility, ONNX Runtime sessions, run limits, memory."""
