"""MambaRadixCache: a radix tree whose nodes hold full-attention KV and Mamba state
slots, with its own node, LRU lists and eviction.

Imports the radix package, the pools and the shared tree parts."""
