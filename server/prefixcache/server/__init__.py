"""The service around the cache library: configuration, gRPC, metrics and the CLI."""
