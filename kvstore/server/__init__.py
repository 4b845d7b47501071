"""The gRPC server of kvstore."""
