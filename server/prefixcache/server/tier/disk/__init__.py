"""The local disk tier (``server.disk``): pages the pool evicts, kept on this node's
disk, below the pool and above the Mooncake tier.

Each model has a store (store.py) in a folder of its own under ``disk.path``
(place.py): one preallocated file of page slots read and written with O_DIRECT from a
thread pool (slot_file.py), an index of the slots in memory evicted by the model's
eviction policy (slot_index.py), and a checked index file and journal that a start
reads instead of the pages (journal.py). disk_tier.py is the tier over the stores,
built on the tier package's machinery (service.py, model_tier.py, fetch.py).

May import the tier package and what it imports; nothing imports it but chain.py.
"""

from .disk_tier import DiskTier, start_disk

__all__ = ["DiskTier", "start_disk"]
