"""A hosted model: its pools, its cache and the slots each session holds, driven on
behalf of sessions (ModelEngine for the radix kinds, SlotEngine for kind ``slot``).

Imports the cache library, the config, sessions and access; never gRPC or the process."""
