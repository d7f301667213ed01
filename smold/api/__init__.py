"""The smol.v1 gRPC API: generated stubs (smold.api.v1), codegen, and dataclass <-> proto conversion."""
