"""Rebuild projections from the ledger with polars; verify, export, what-if."""
