"""RadixTrie: Modular MAX's prefix trie from token pages to caller-owned blocks, with
per-sequence in-use marks.

Imports the shared key and eviction-queue parts and the radix package's page compare;
nothing imports it but the package's ``__init__``."""
