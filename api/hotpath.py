"""The hot routes served straight from the middleware stack, past FastAPI's routing.

A chat request spent about a third of the API's CPU in the framework between the guard and the
endpoint: matching the path against every route in turn, the dependency solver, the exception and
exit-stack middlewares, each a coroutine frame and a `send` wrapper (bench/api.py --profile). The
hot routes take no parameters from FastAPI (their endpoints read the body themselves, with msgspec:
api.common.read_body), so `HotPath` calls their endpoints directly, found by method and path in a
dict, with the guard, the dashboard's shell and the metrics in front as before. What they raise
goes to the app's own exception handlers, as it would inside FastAPI; what has no handler goes on
to the server's error middleware (a 500). The routes stay registered with FastAPI for the OpenAPI
document and for any path this lane does not know.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from fastapi import FastAPI
from fastapi.routing import APIRoute, APIRouter
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# (method, path) of each route served here.
HOT_ROUTES: Final = frozenset(
    {("POST", "/v1/chat/completions"), ("POST", "/api/chat"), ("POST", "/v1/tasks")}
)


class HotPath:
    """ASGI middleware, innermost of the app's own: serves HOT_ROUTES, passes everything else on."""

    def __init__(self, app: ASGIApp, *, fastapi: FastAPI, routers: Sequence[APIRouter]) -> None:
        self.app = app
        self.fastapi = fastapi
        # From the routers as declared (included without a prefix): FastAPI keeps an included
        # router as an internal wrapper, not as its routes.
        self.routes = {
            (method, route.path): route
            for router in routers
            for route in router.routes
            if isinstance(route, APIRoute)
            for method in route.methods or ()
            if (method, route.path) in HOT_ROUTES
        }
        missing = HOT_ROUTES - set(self.routes)
        if missing:
            raise ValueError(f"no endpoint for the hot routes {sorted(missing)}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            root: str = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            route = self.routes.get((scope["method"], path))
            if route is not None:
                await self._serve(route, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, route: APIRoute, scope: Scope, receive: Receive, send: Send) -> None:
        # What routing would have recorded: the metrics and the access log label by route.
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        request = Request(scope, receive, send)
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            response = await route.endpoint(request)
            await response(scope, receive, sending)
        except Exception as exc:
            handler = _handler(self.fastapi.exception_handlers, exc)
            if handler is None or started:
                raise
            answer = await handler(request, exc)
            await answer(scope, receive, sending)


def _handler(handlers: dict[Any, Any], exc: Exception) -> Any:
    """The app's handler for `exc`, by its class and then its bases, as Starlette looks it up."""
    for cls in type(exc).__mro__:
        found = handlers.get(cls)
        if found is not None:
            return found
    return None
