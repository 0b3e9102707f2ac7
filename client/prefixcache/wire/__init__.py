"""Wire formats both sides speak, neutral ground for the client and the server.

Each module here knows its format and nothing of who uses it: it imports the standard
library only (not torch, not protobuf, not ``prefixcache.client``, ``server`` or
``cache``), so the client and the server may both import it (tests/test_layering.py).
"""
