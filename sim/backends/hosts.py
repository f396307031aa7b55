"""Simulated machines that speak Ollama's HTTP API, several per process, each on its own port.

    async with SimHosts(load_fleet("seed"), time_scale=0.1, seed=7) as hosts:
        ollama.AsyncClient(hosts.url("rtx3070ti"))
        await hosts.go_offline("rtx3070ti")      # the port closes, as when the PC is shut down

A machine that is offline has no port to ask, so the process also serves a control port
(`SimHosts.control_url`) with `/sim/{machine}/…` for every machine, `online` included. What one
machine serves is told in sim/backends/host.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import msgspec
from starlette.types import Receive, Scope, Send

from sim.backends.host import MachineApp
from sim.backends.listener import Listener, read_body, respond
from sim.backends.machine import Faults, MachineState, SimMachine
from sim.backends.wire import FaultsRequest, ModelRequest, decode_body
from sim.backends.wol import WakeListener, open_wake_listener
from sim.errors import BadRequestError, SimHostError
from sim.fleetspec import Fleet, WorkerSpec

log = logging.getLogger(__name__)

_enc = msgspec.json.Encoder()

# -- the control port -----------------------------------------------------------------------------


class ControlApp:
    """`/sim/{machine}/…` for every machine of the process, reachable while a machine is offline."""

    def __init__(self, hosts: SimHosts) -> None:
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            await self._handle(scope, receive, send)
        except BadRequestError as exc:
            await respond(send, 400, _enc.encode({"error": str(exc)}))
        except SimHostError as exc:
            await respond(send, 404, _enc.encode({"error": str(exc)}))

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        parts = [p for p in scope["path"].split("/") if p]
        hosts = self.hosts
        if parts in (["sim"], ["sim", "state"]) and method == "GET":
            body = {
                "hosts": hosts.urls,
                "control": hosts.control_url,
                "machines": [hosts.state(n) for n in hosts.names],
            }
            await respond(send, 200, _enc.encode(body))
            return
        if len(parts) != 3 or parts[0] != "sim":
            await respond(send, 404, b"404 page not found", b"text/plain")
            return
        name, action = parts[1], parts[2]
        hosts.machine(name)
        if (method, action) == ("GET", "state"):
            pass
        elif (method, action) == ("POST", "faults"):
            req = decode_body(await read_body(receive), FaultsRequest)
            hosts.set_faults(
                name, error_rate=req.error_rate, hang_rate=req.hang_rate, disconnect_rate=req.disconnect_rate
            )
        elif (method, action) == ("POST", "offline"):
            await hosts.go_offline(name)
        elif (method, action) == ("POST", "online"):
            await hosts.go_online(name)
        elif (method, action) == ("POST", "pull"):
            hosts.give_model(name, decode_body(await read_body(receive), ModelRequest).which)
        else:
            await respond(send, 404, b"404 page not found", b"text/plain")
            return
        await respond(send, 200, _enc.encode(hosts.state(name)))


# -- the process-level API ------------------------------------------------------------------------


class SimHosts:
    """Several simulated machines on loopback ports, served from the running event loop."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        time_scale: float = 1.0,
        seed: int = 0,
        host: str = "127.0.0.1",
        control_port: int = 0,
        windows: bool = True,
    ) -> None:
        self.fleet = fleet
        self.host = host
        self.time_scale = time_scale
        self.seed = seed
        self._apps: dict[str, MachineApp] = {}
        for spec in fleet.worker:
            machine = SimMachine(spec, fleet, time_scale=time_scale, seed=seed)
            self._apps[spec.name] = MachineApp(machine)
        self._control = Listener(ControlApp(self), host, control_port)
        self._windows = windows
        self._window_tasks: list[asyncio.Task[None]] = []
        self._started = False
        # Sleeping machines (spec.asleep): each one's network card, its pending power-on, and an
        # event set when it has powered on after a magic packet.
        self.wake_listeners: dict[str, WakeListener] = {}
        self.woken: dict[str, asyncio.Event] = {
            spec.name: asyncio.Event() for spec in fleet.worker if spec.asleep
        }
        self._boots: dict[str, asyncio.Task[None]] = {}
        # Every datagram each card received, kept after the hosts stop (for a test to look at).
        self._heard: dict[str, list[bytes]] = {}

    async def __aenter__(self) -> SimHosts:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Open every machine's port (and the control port)."""
        if self._started:
            return
        try:
            for name, app in self._apps.items():
                app.listener = Listener(app, self.host, app.machine.spec.port)
                await app.listener.open()
                if self._windows and app.machine.spec.online is not None:
                    self._window_tasks.append(
                        asyncio.create_task(self._follow_windows(name, app.machine.spec))
                    )
                if app.machine.spec.asleep:
                    await self._fall_asleep(name, app.machine.spec)
            await self._control.open()
        except OSError as exc:
            await self.stop()
            raise SimHostError(f"cannot listen on {self.host}: {exc.strerror or exc}") from None
        self._started = True

    async def stop(self) -> None:
        for boot in self._boots.values():
            boot.cancel()
        self._boots.clear()
        for card in self.wake_listeners.values():
            card.close()
        self.wake_listeners.clear()
        for task in self._window_tasks:
            task.cancel()
        for task in self._window_tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._window_tasks.clear()
        for app in self._apps.values():
            app.machine.power_off()
            if app.listener is not None:
                await app.listener.close()
            app.cancel_all()
        await self._control.close()
        # Let cancelled handlers unwind before the loop may close.
        await asyncio.sleep(0)
        self._started = False

    # -- lookups ------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._apps)

    def _app(self, name: str) -> MachineApp:
        app = self._apps.get(name)
        if app is None:
            raise SimHostError(f"no simulated machine {name!r}; machines: {', '.join(self._apps)}")
        return app

    def machine(self, name: str) -> SimMachine:
        return self._app(name).machine

    def url(self, name: str) -> str:
        """The machine's base URL (the same across offline/online)."""
        listener = self._app(name).listener
        if listener is None:
            raise SimHostError("the sim hosts are not started")
        return f"http://{_url_host(self.host)}:{listener.port}"

    @property
    def urls(self) -> dict[str, str]:
        return {name: self.url(name) for name in self._apps}

    @property
    def control_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self._control.port}"

    # -- controls -----------------------------------------------------------------------------

    def state(self, name: str) -> MachineState:
        return self.machine(name).state()

    def set_faults(
        self,
        name: str,
        *,
        error_rate: float | None = None,
        hang_rate: float | None = None,
        disconnect_rate: float | None = None,
    ) -> Faults:
        return self.machine(name).set_faults(
            error_rate=error_rate, hang_rate=hang_rate, disconnect_rate=disconnect_rate
        )

    def give_model(self, name: str, model: str) -> str:
        """Give machine `name` a model its preset lists (as `POST /api/pull` does); its full name."""
        return self.machine(name).give_model(model)

    def take_model(self, name: str, model: str) -> None:
        """Remove a model from machine `name` (as `DELETE /api/delete` does)."""
        self.machine(name).take_model(model)

    def is_online(self, name: str) -> bool:
        return self.machine(name).online

    async def go_offline(self, name: str, keep: asyncio.Transport | None = None) -> None:
        """Power the machine off: its port closes, open connections drop, loaded models are lost."""
        await self._app(name).power_off(keep=keep)

    async def go_online(self, name: str) -> None:
        """Power the machine on again, on the same port; nothing is loaded."""
        app = self._app(name)
        if app.listener is None:
            raise SimHostError("the sim hosts are not started")
        try:
            await app.listener.open()
        except OSError as exc:
            raise SimHostError(
                f"{name} cannot listen on its port {app.listener.port} again: {exc.strerror or exc}"
            ) from None
        app.machine.power_on()

    # -- sleeping machines -----------------------------------------------------------------------

    async def _fall_asleep(self, name: str, spec: WorkerSpec) -> None:
        """Power the machine off and open its network card for its magic packet."""
        await self.go_offline(name)
        assert spec.mac is not None  # parse_fleet refuses a sleeping machine without one
        card = await open_wake_listener(self.host, spec.wake_port, spec.mac, lambda: self._on_magic(name))
        self.wake_listeners[name] = card
        self._heard[name] = card.received

    def wake_port(self, name: str) -> int:
        """The UDP port where sleeping machine `name` listens for its magic packet."""
        card = self.wake_listeners.get(name)
        if card is None:
            raise SimHostError(f"{name} is not a sleeping machine")
        return card.port

    def packets(self, name: str) -> list[bytes]:
        """Every datagram sleeping machine `name`'s card has received, in order."""
        return list(self._heard.get(name, []))

    def _on_magic(self, name: str) -> None:
        if self.is_online(name) or name in self._boots:
            return
        self._boots[name] = asyncio.get_running_loop().create_task(self._boot(name))

    async def _boot(self, name: str) -> None:
        """Power on `wake_s` (scaled) after the magic packet, as a machine boots."""
        machine = self.machine(name)
        await asyncio.sleep(machine.spec.wake_s * machine.timer_scale)
        await self.go_online(name)
        self._boots.pop(name, None)
        self.woken[name].set()

    async def _follow_windows(self, name: str, spec: WorkerSpec) -> None:
        windows = sorted(spec.online or [])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        scale = self.machine(name).timer_scale

        def on_at(t: float) -> bool:
            return any(start <= t < end for start, end in windows)

        edges = sorted({e for w in windows for e in w if math.isfinite(e) and e > 0})
        if not on_at(0.0):
            await self.go_offline(name)
        for edge in edges:
            await asyncio.sleep(max(0.0, t0 + edge * scale - loop.time()))
            want = on_at(edge)
            if want and not self.is_online(name):
                await self.go_online(name)
            elif not want and self.is_online(name):
                await self.go_offline(name)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


__all__ = ["Faults", "MachineApp", "MachineState", "SimHosts", "SimMachine"]
