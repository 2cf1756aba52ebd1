"""The KServe v2 protocol over gRPC (`grpc_service.proto` as Triton ships it), beside the HTTP API.

`tritonclient.grpc` works unchanged against it: the same queues, keys (`authorization` metadata),
tenants and priorities as HTTP (docs/api.md, "gRPC"). `python -m sits_api.grpc` runs it.
"""
