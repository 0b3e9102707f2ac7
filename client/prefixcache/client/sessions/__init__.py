"""A client's sessions: the leased session of the blocking client (renewed by a thread),
the asyncio client's leased session (renewed by a task) and its Session-stream session,
with the flows they share (step's retry loop, reopen, close, renewal) and the Protocols
that name what a session needs of its client.

Imports the client's core, errors, results and Step; the clients (sync.py, aio.py)
import it, never the other way round."""
