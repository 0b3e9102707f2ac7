"""Moving KV between a worker and the service: map a pool zero-copy on the service's host
(attach) and turn ReadKV and WriteKV chunks into tensors and back (kv). The calls that
use them are the clients' (_core.py, pages.py).

Imports the client's errors, results and wire helpers; never a session or client class,
and never torch at import time."""
