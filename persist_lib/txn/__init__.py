"""Transactions across shards and collections (issue 27, item 1).

A shard advances by its own compare-and-set, so writing several shards one after
another is not atomic: a writer that dies between shards leaves some at the new upper
and some at the old. This package makes a write to any number of shards one atomic,
definite step, with one extra shard per location, the **txn log** (``log.py``).

What is guaranteed
------------------
* A transaction is a set of batches, one per data shard it touches, each with its own
  ``[lower, upper)``. It commits with ONE ``compare_and_append`` on the txn log, or not
  at all: every reader of every touched shard sees all of its batches or none.
* A commit is a *compare-and-append over all touched shards at once*: it applies iff
  each shard's **logical upper** (below) equals its batch's ``lower``; otherwise it raises
  ``UpperMismatch`` for the first shard that moved, and nothing was committed.
* Data shards keep their own timelines (collections here have independent clocks), so
  the txn log's own time is only its *log position*: it orders commits, it is not the
  data time. A multi-collection ``ctl.transaction()`` picks one data time for all of its
  collections; that is the controller's choice (``storage/transactions.py``), not a
  property of the log.
* Nothing committed is ever lost, whatever crashes when; nothing is applied twice.

The protocol
------------
**Register.** A data shard is registered once (a ``(shard, "")`` row in the log,
idempotent). From then on it is written only through transactions.

**Write.** For each touched shard the committer registers a fresh *transaction part
writer* on that shard (``PartWriter`` with a lease of ten years: it never lapses by
itself) and writes the shard's batch as ordinary parts under that writer's key prefix;
the parts are not linked into the shard. The leaked-blob sweeper never deletes parts of
a registered writer, so they survive for as long as the transaction needs them.

**Commit** = the WAL step. The committer reads the log at its upper ``L`` (one
consolidated snapshot at ``L - 1``: registrations plus committed-but-untidied
entries), computes each touched shard's logical upper (the ``upper`` of the shard's last
pending entry, else the shard's physical upper) and, if every one equals its batch's
``lower``, does one ``compare_and_append`` on the log at ``[L, L + 1)`` whose updates are
pointers ``((data shard, txn id), (serialized HollowBatch,))``. If the log moved (another
commit, a tidy), the check is redone against the new log, and the same batches are
committed at the next position: parts are never rewritten for a log retry, because the
log position is not the data time. A data shard's upper moving is a definite
``UpperMismatch``: the part writers are released and the parts deleted.

**Apply.** Each pointer is then linked into its data shard by that shard's own
compare-and-set (``apply.py``): a transition that appends the batch iff the shard's
upper is the batch's ``lower`` and, in the same state change, unregisters the batch's
part writer. It is idempotent (a shard already at or past the batch's ``upper`` has it:
only transactions write a registered shard, in log order) and anyone may run it: the
committer right after the commit, the next committer, any reader of the shard before it
reads (``Txns.ensure_applied``), maintenance (``Txns.apply_all``). Entries of one shard are
applied in the order of their ``lower``.

**Tidy.** An entry whose shard's physical upper reached the batch's ``upper`` is applied;
tidy retracts it from the log (``-1`` at a later log position), so the log holds only
registrations and not-yet-applied transactions. Tidy never retracts an entry that is not
applied (that would lose a committed transaction).

**Follow-ups.** A commit may carry ``advances``: ``(shard, upper)`` rows in the same log
CAS (``log.Advance``), applied by whoever applies the transaction (an empty append that
moves the shard's upper to at least ``upper``; idempotent, in any order) and tidied once
the shard's upper is there. Storage commits the move of the collection's *metadata*
upper this way (only for the active rendition), so a committer killed after its commit
CAS leaves its time readable by the next reader, not waiting for its metadata forever.

**Forget.** Deleting a collection (or rolling back or dropping a rendition) finalizes its
shards and then retracts their registrations (``Txns.forget``, one log CAS, idempotent);
their untidied entries are applied trivially (a finalized shard's upper is empty) and
go with the next tidy. The catalog records the delete until this is done, so a
controller killed in between is finished by ``recover``.

**Read.** A reader of a registered shard first applies the shard's pending entries
(``ensure_applied``), then reads the shard as usual. Readers of different shards stay
independent. A committed transaction becomes readable at its times as soon as any
party applies it.

Crash cases
-----------
* Before the commit CAS: the log does not hold the transaction, so nobody ever applies
  it. Its parts stay (their part writers are registered) until ``Txns.recover_orphans``
  proves the transaction can never commit: the committer's log writer is no longer
  registered in the log's state ``S`` (its lease lapsed) and the log at ``upper(S) - 1``
  holds no entry of the part writer. A commit by that writer would have landed in a
  state ``<= S``, hence be visible there (tidy happens only after apply, which also
  unregisters the part writer). It then releases the part writers; the sweeper collects
  the parts.
* The commit CAS indeterminate: ``Indeterminate`` is raised to the caller; the log decides
  (the entry is there or it is not), and the two cases above/below apply.
* After the commit CAS, between applies, during tidy: the next committer, reader or
  maintenance applies what is pending (each apply is a CAS on one shard that either
  links the batch and unregisters its part writer, or finds the shard past it) and tidies
  what is applied.

Costs: per touched shard one part-writer registration, the parts, one apply CAS (the
per-shard steps run in parallel); plus one log CAS per transaction and one for its tidy.
The committer's tidy retracts the entries of its own shards (those its cached shard
states show applied) right after the commit, without reading the log again, and the
log view it produced is remembered (``TxnLog.append(then=...)``), so the next commit
of the process reads no snapshot while nobody else wrote the log. All commits
serialize on the log's upper, so heavily contended commits retry.

Prebuilt batches (a Spark job's executors write the parts): ``Txns.prepare`` registers
the part writers, the caller writes each shard's parts under ``Prepared.part_writer``,
``Txns.commit_batches`` commits (``abandon`` on failure).
"""
