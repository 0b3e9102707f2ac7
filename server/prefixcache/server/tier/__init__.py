"""The shared cross-node KV tier: a store below each model's pool (``server.tier``).

Pages that one sidecar caches are written to a distributed store (Mooncake Store),
keyed by their chained page hashes and a model fingerprint (keys.py), so that another
sidecar with the same model config finds them after its own local hit, fetches them
into its pool and answers them as a hit (fetch.py). Writes go through a bounded queue
on a thread of their own (writer.py); every store call runs off the event loop and is
bounded by ``tier.timeout`` (service.py).

Every object carries a seal over the page's bytes and identity, checked before a
fetched page enters a tree (seals.py; with ``tier.secret_file`` a MAC, and keyed keys).

Modules: backend.py (the store interface and its error codes), mooncake_backend.py (the
Mooncake Store client), keys.py (object keys and page identities), layout.py (a page's
bytes in the pool), seals.py (seal slots, sealing and checking), writer.py (the put
queue), staging.py (write-back's copies of evicted pages), model_tier.py (one model's
hooks: new pages in, reset), fetch.py and fetch_pages.py (the read paths), store_read.py
(a read's slots and deadline), service.py (the tier of one server), metrics.py (its
Prometheus collector).
"""

from .service import Tier, start_tier

__all__ = ["Tier", "start_tier"]
