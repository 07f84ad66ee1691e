"""The shard machinery (persist's internals): state and its pure transitions, the
compare-and-set machine that applies them, the spine and compaction, garbage collection,
parts and their codecs, kernels. Nothing here imports a handle, the client or anything above.
"""
