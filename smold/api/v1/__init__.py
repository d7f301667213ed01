"""Generated smol.v1 stubs (smol_pb2, smol_pb2_grpc): written by `python -m smold.api.codegen`, never by hand."""
