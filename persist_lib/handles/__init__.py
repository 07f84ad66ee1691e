"""The public handles and the client that opens them: ``PersistClient``, ``ReadHandle``,
``WriteHandle``, and the maintenance API. They hold a shard's machine; they are what
``from persist_lib import ...`` gives a user.
"""
