"""The ledger: event types, their codec, Redis key names and the Ledger over Redis Streams."""

from events.codec import decode_entry, encode_event
from events.errors import LedgerError, RouteledgerError, UndecodableEntryError
from events.event import Event
from events.keys import Keys
from events.ledger import Ledger

__all__ = [
    "Event",
    "Keys",
    "Ledger",
    "LedgerError",
    "RouteledgerError",
    "UndecodableEntryError",
    "decode_entry",
    "encode_event",
]
