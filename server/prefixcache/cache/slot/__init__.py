"""SlotPrefixCache: a radix tree from token prefixes to per-sequence KV slots.

Imports the radix package, the pools and the shared tree parts."""
