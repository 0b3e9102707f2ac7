"""The gRPC adapter: decode a request, make one call into the service, encode the
reply; Step, the page RPCs, Explain, KV transfer chunks and the status-code table.

The top of the request path: imports the service, engines, sessions, access and events;
nothing imports it but the process (app.py, cli.py)."""
