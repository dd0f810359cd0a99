"""kv_transfer: KVTransport interface with nixl, tcp and local backends.

Not built yet: issue [F1]. The engine's KVCache.read_blocks / write_blocks are its endpoints.
"""
