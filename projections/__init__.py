"""Stream processors that fold ledger events into tables, with checkpoints.

Readers call `projections.reader` (snapshot, get_task, lag); `projections.projector.Projector`
folds; `projections.snapshot` holds the types. This package imports nothing on its own, so that
the pure router can import the snapshot types without Redis.
"""
