"""The radix tree kinds: RadixCache, SWARadixCache, their eviction, the lookup outcomes
(why a key did not hit) and the tree snapshot a warm restart keeps.

Imports the shared tree parts (key, node, eviction, inspection), pools and index."""
