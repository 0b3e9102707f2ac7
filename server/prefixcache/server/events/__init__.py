"""What the cache tells the outside about its pages: KV events over ZMQ (publisher,
wire format, replay of missed batches) and the Subscribe streams with their change feeds.

Imports the cache library (its change log), the config and the service; never the rpc
package."""
