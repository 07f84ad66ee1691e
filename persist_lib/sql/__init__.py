"""SQL over shards and collections (``persist sql``): DuckDB over snapshots as of a time,
read-only by construction (``guard``).
"""
