"""The pools' memory: shared files other processes map, sizing before anything is
allocated, write fences for copies through a mapped pool, and the warm restart that keeps
the pools across a clean restart.

Imports the config, sessions and the cache library."""
