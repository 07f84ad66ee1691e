"""The Dagster code location of the persist platform (``dagster_project.definitions``).

The code server and every run process import this package before anything imports
pyarrow: the allocator is chosen here so that the memory budgets of reads and compaction
hold in RSS too (``persist_lib/allocator.py`` says why).
"""

from persist_lib.allocator import configure_bounded_allocator

configure_bounded_allocator()
