"""Memory: allocators that hand out pool slots (paged, SWA pairs, per-sequence), the
free lists behind them, and the K/V and Mamba state buffers they address.

The bottom of the library: imports only the cache's errors."""
