"""Test infrastructure shared by the test modules: a throwaway Postgres server
(``pg_server``) and the moto S3 server (``moto_server``). The pytest fixtures that use
them live in ``tests/conftest.py``."""
