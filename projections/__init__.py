"""Stream processors that fold ledger events into tables, with checkpoints."""
