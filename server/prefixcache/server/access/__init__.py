"""Who may do what: bearer tokens, tenants and their namespaces, who a peer is (the
kernel's word on the unix socket and on loopback), the limits and quotas one client may
use of a shared service, the turns its long calls take, and which KV rows a transfer
may touch.

Imports the service's errors and config, the sessions it charges, and the cache library;
nothing of the rpc package, the engines or the process."""
