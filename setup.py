"""The one compiled piece: an optional C accelerator of the Kafka reader (it splits a
consumed batch by partition in one pass; see persist_lib/ingest/kafka/_split.c). Built by
``pip install`` when a C compiler and Python's headers are there; without it (or with
PERSIST_KAFKA_NATIVE=0) the reader runs the same logic in Python. Everything else is in
pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("persist_lib.ingest.kafka._split", ["persist_lib/ingest/kafka/_split.c"], optional=True),
    ]
)
