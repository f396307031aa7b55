"""`routeledger wake NAME`: wake a sleeping machine by hand (and register one with `--mac`).

The waker in the reaper wakes a machine when the plan says it pays (workers/waker.py); this sends
the same packet on an operator's word, through the same rate limit, and records WakeRequested with
why="manual". A machine whose worker never ran with `--wake-mac` is registered here with `--mac`.
"""

from __future__ import annotations

from typing import Annotated

import redis.asyncio as aioredis
import typer

from dispatch.errors import WakeError
from dispatch.view import LiveView
from dispatch.wake import (
    DEFAULT_BROADCAST,
    DEFAULT_PORT,
    DEFAULT_WAKE_S,
    DEFAULT_WINDOW_S,
    SleepRecord,
    normalize_mac,
    read_record,
    read_records,
    record_from_lease,
    wake,
    write_record,
)
from events.event import now_ms
from routeledger.runtime import Instance, command, console, fail, print_json
from tasks.lease import live_workers
from workers.config import WORKER_NAME


@command()
def wake_cmd(
    inst: Instance,
    name: Annotated[str, typer.Argument(help="The sleeping machine's worker name.")],
    mac: Annotated[
        str | None, typer.Option(help="Register (or change) its MAC address, e.g. AA:BB:CC:DD:EE:FF.")
    ] = None,
    broadcast: Annotated[
        str, typer.Option(help="Where the magic packet goes, with --mac.")
    ] = DEFAULT_BROADCAST,
    port: Annotated[int, typer.Option(min=1, max=65535, help="UDP port of the magic packet, with --mac.")] = (
        DEFAULT_PORT
    ),
    wake_s: Annotated[
        float, typer.Option("--wake-s", min=0.0, help="Seconds it takes to wake and serve, with --mac.")
    ] = DEFAULT_WAKE_S,
    send: Annotated[bool, typer.Option(help="Send the packet (--no-send: only register --mac).")] = True,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Send a sleeping machine its magic packet (once per minute at most) and record WakeRequested."""
    if not WORKER_NAME.fullmatch(name):
        fail(f"{name!r} is not a worker name (1-64 letters, digits, '.', '_' or '-')")
    if mac is not None:
        try:
            mac = normalize_mac(mac)
        except WakeError as exc:
            fail(exc.message)
    keys = inst.keys

    async def go(client: aioredis.Redis) -> dict[str, object]:
        leases = await live_workers(client, keys)
        rec = await read_record(client, keys, name)
        if mac is not None:
            lease = leases.get(name)
            if lease is not None:
                rec = record_from_lease(lease, mac, broadcast=broadcast, port=port, wake_s=wake_s)
            else:
                # Asleep now: what it serves is what its record said (nothing, for a new one: the
                # waker plans for it once its worker has run and said what it holds).
                rec = SleepRecord(
                    worker=name,
                    mac=mac,
                    broadcast=broadcast,
                    port=port,
                    wake_s=wake_s,
                    slots=1 if rec is None else rec.slots,
                    holds=[] if rec is None else rec.holds,
                    models=[] if rec is None else rec.models,
                )
            await write_record(client, keys, rec)
        if rec is None:
            known = sorted(await read_records(client, keys))
            fail(
                f"no sleeping machine named {name!r} (known: {', '.join(known) or 'none'}); "
                f"register it with `routeledger wake {name} --mac AA:BB:CC:DD:EE:FF`"
            )
        out: dict[str, object] = {"worker": name, "mac": rec.mac, "sent": False}
        if not send:
            out["status"] = "registered"
            return out
        if name in leases:
            out["status"] = "online"
            return out
        snap, _ = await LiveView(client, keys).estimates()
        counted = rec.wake_time(snap.fleet.get(name), now_ms())
        try:
            event = await wake(client, keys, rec, why="manual", window_s=DEFAULT_WINDOW_S, wake_time=counted)
        except WakeError as exc:
            fail(exc.message, 1)
        if event is None:
            out["status"] = "rate-limited"
            return out
        out.update(sent=True, status="sent", wake_s=event.wake_s, wake_source=event.wake_source)
        out["bound_s"] = rec.bound_s(counted.seconds)
        return out

    out = inst.run(go)
    if json_:
        print_json(out)
        return
    status = out["status"]
    if status == "registered":
        console.print(f"registered {name} ({out['mac']}); no packet sent")
    elif status == "online":
        console.print(f"{name} is online; no packet sent")
    elif status == "rate-limited":
        console.print(
            f"a magic packet went to {name} within the last {DEFAULT_WINDOW_S:.0f}s; not sent again"
        )
    else:
        console.print(
            f"sent {name} its magic packet ({out['mac']}); expected online in {out['wake_s']:.0f}s"
            f" ({out['wake_source']}), WakeFailed after {out['bound_s']:.0f}s"
        )
