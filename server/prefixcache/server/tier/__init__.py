"""The tiers below each model's pool (``server.tier``, ``server.disk``).

Two stores below the pools, consulted in this order after a lookup's local hit
(chain.py): a local disk tier per model (disk/: pages the pool evicts, in one
preallocated file of slots with a checked index, surviving restarts), and the shared
cross-node tier on a distributed store (Mooncake Store), so that another sidecar with
the same model config finds a page after its own hit. Pages are keyed by their chained
page hashes and a model fingerprint (keys.py); a lookup brings the pages that follow
its hit into the pool and answers them as a hit (fetch.py). Writes go through a
bounded queue on a thread of their own (writer.py); every store call runs off the event
loop and is bounded by the tier's ``timeout`` (service.py).

Every object carries a seal over the page's bytes and identity, checked before a
fetched page enters a tree (seals.py; with ``tier.secret_file`` a MAC, and keyed keys).

Modules: backend.py (the store interface and its error codes), mooncake_backend.py (the
Mooncake Store client), keys.py (object keys and page identities), layout.py (a page's
bytes in the pool), seals.py (seal slots, sealing and checking), writer.py (the put
queue), staging.py (write-back's copies of evicted pages), model_tier.py (one model's
hooks: new pages in, reset), fetch.py and fetch_pages.py (the read paths), store_read.py
(a read's slots and deadline), service.py (a tier of one server, and the Mooncake one),
chain.py (the tiers in lookup order), explain.py (a tier's part of the Explain RPC),
metrics.py (their Prometheus collector); disk/
(the disk tier's store). May import the service's lower layers (config, access,
engine, memory, rpc's request checks), never app.py or cli.py.
"""

from .chain import Tiers, start_tiers
from .service import MooncakeTier, Tier, start_tier

__all__ = ["MooncakeTier", "Tier", "Tiers", "start_tier", "start_tiers"]
