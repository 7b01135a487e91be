"""The gRPC stubs of proto/nightjar/v1/inference.proto (scripts/gen_proto.sh writes them)."""
