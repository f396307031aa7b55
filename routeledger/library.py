"""Every Lua function of the code base, for the processes that load the library for others.

Scripts are defined (events.scripts.ScriptDef) by the modules that run them, and the library is
made of those a process has imported: `events` imports nothing above it, so the composition root
names them here, and every command imports this module before it runs (routeledger.runtime). A
worker under its ACL cannot load the library; it finds every function it calls loaded by the
projector, whose process imported this.
"""

from __future__ import annotations

# Imported for the scripts they define, which join the library.
from dispatch import view
from events import ledger
from tasks import lease, store

MODULES = (ledger, store, lease, view)
