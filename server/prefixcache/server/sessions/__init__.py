"""Client sessions: who holds which locks and slots, for how long, and what they keep
(leases, keep-alive pacing, retried replies, opaque ids, the lock audit).

Imports the service's errors, access and the cache library."""
