"""The pools' memory: shared files other processes map (reserved after the start, or
mapped lazily when private), sizing before anything is allocated, write fences for
copies through a mapped pool, page seals, and the warm restart (snapshots, seals over
the trees' KV, checkpoints while serving) that keeps the cache across a restart, clean
or not.

Imports the config, sessions and the cache library."""
