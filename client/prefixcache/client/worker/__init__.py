"""What runs inside an engine's scheduler over the service: RemoteRadixCache with SGLang's
prefix-cache API (local and remote), the drop-in allocators, the Step buffer and the
admission window; RemoteRadixTrie (Modular MAX's RadixTrie API) and
RemoteMambaRadixCache (the MambaRadixCache API).

Sits on top of the client: imports its sessions, clients and shadow index; nothing in
the client imports it (the package's ``__init__`` re-exports the drop-ins, lazily)."""
