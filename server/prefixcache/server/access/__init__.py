"""Who may do what: bearer tokens, tenants and their namespaces, the limits and quotas
one client may use of a shared service, and which KV rows a transfer may touch.

Imports the service's errors and config, the sessions it charges, and the cache library;
nothing of the rpc package, the engines or the process."""
