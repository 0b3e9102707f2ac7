"""Moving KV between a worker and the service: map a pool zero-copy on the service's host
(attach), ReadKV and WriteKV chunks to and from tensors (kv), and pages by chained hash
(pages).

Imports the client's errors, results and wire helpers; never a session or client class,
and never torch at import time."""
