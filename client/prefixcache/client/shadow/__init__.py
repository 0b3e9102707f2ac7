"""The shadow index: a worker's replica of one model's cached page set (shadow), kept
current from the Subscribe stream in the background (shadow_follow), for ranking
candidates without a round trip; the worker's own pages show in it at once, through a
local overlay the stream reconciles (overlay).

Imports the client's errors and page chains; never a session or client class."""
