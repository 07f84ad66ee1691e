"""Reliability harness for persist_lib (tests only; nothing in the library imports it).

- ``history``: the per-actor JSON-lines event log (invoke/complete records) and its merge.
- ``audit``: location wrappers that archive consensus entries before truncation and log
  (and keep a copy of) every blob delete, so a history can be checked after the fact.
- ``model``: a pure in-memory model of one shard (used by the stateful test and the checker).
- ``actors`` / ``runner``: randomized concurrent histories in real OS processes, with
  injected faults, outages and a crash nemesis.
- ``checker``: turns a finished history into a list of violations by kind.
- ``planted``: deliberately broken variants that the checks must catch (test-only).
- ``figures``: the reliability figures table (text + JSON).
- ``txn_config`` / ``txn_actors`` / ``txn_history`` / ``txn_checker``: transactions
  histories (transactional collections, kill -9 at every protocol step) and their checker;
  ``txn_stateful``: the state machine of transactional collections; ``txn_control``: a
  committer killed at one step, then one other party.
"""
