"""What stands between the network and dsv4-serve's handlers: errors in OpenAI's shape, the API
key, the request body's size and read deadline, a deadline for a request's headers, and a
shutdown that half-sent requests cannot hold open.

- `APIError` / `error_response`: every error the server sends, `{"error": {"message", "type",
  "param", "code"}}` with the HTTP status as `code`, escaped to ASCII so that a message quoting
  the request's own text (a lone surrogate included) always renders.
- `Gate`, an ASGI middleware around the app: `/v1/*` needs `Authorization: Bearer KEY` when the
  server has a key (401 otherwise, compared in constant time); the body is read whole before the
  app sees it, refused with 413 once it passes `max_body` bytes (before reading any of it when
  its Content-Length says so; uvicorn then reads the rest and throws it away, so the client sees
  the answer and may send its next request on the connection, within the header deadline below)
  and with 408, closing the connection, when it has not all arrived `read_timeout` seconds after
  the headers; an exception no handler took becomes a 500 in the same shape on a connection that
  stays open (Starlette's own error middleware answers, then re-raises, and uvicorn drops the
  connection).
- `protocol(read_timeout)`: uvicorn's h11 protocol with a deadline for a request's headers
  (counted from the connection's start or the previous response's end; uvicorn's own keep-alive
  timeout is reset by any byte, so a client trickling headers would hold a connection for good),
  and a graceful shutdown that closes a connection whose request body is still arriving instead
  of waiting for it. Requests whose body has arrived are in flight and run on, up to uvicorn's
  `timeout_graceful_shutdown`; then uvicorn cancels them, and `Gate` ends each (a 503 when it
  has sent nothing yet) instead of passing the cancellation on as an error with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import traceback

STATUS_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               500: "internal_server_error", 503: "service_unavailable"}

log = logging.getLogger("uvicorn.error")


class APIError(Exception):
    """An error response: HTTP status, message, and the request field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": STATUS_TYPE.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


def error_json(e: APIError) -> bytes:
    return json.dumps(e.body(), ensure_ascii=True).encode()


def error_response(e: APIError, headers: dict | None = None):
    """The Starlette response for an APIError."""
    from starlette.responses import Response

    return Response(error_json(e), status_code=e.status, headers=headers, media_type="application/json")


async def _send_error(send, e: APIError, headers: dict[str, str] | None = None) -> None:
    body = error_json(e)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


CLOSE = {"Connection": "close"}


class Gate:
    """ASGI middleware: API key, body size and read deadline, internal errors (module doc)."""

    def __init__(self, app, *, api_key: str | None, max_body: int, read_timeout: float):
        self.app, self.max_body, self.read_timeout = app, max_body, read_timeout
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if self.api_key is not None and (scope["path"] + "/").startswith("/v1/") and not self._authorized(scope):
                return await _send_error(send, APIError(401, "Missing or incorrect API key: send it as "
                                                             "'Authorization: Bearer <key>'"),
                                         {"WWW-Authenticate": "Bearer"})
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            await self.app(scope, _replay(body, receive), tracked)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when the graceful shutdown times out. The request
            # ends here: a 503 if nothing was sent yet, else its connection is closed (uvicorn
            # closes one whose response the app left unfinished), one log line, no traceback.
            log.warning("%s %s cut off by the shutdown (--timeout-graceful-shutdown)", scope["method"], scope["path"])
            if not started:
                with contextlib.suppress(Exception):
                    await _send_error(send, APIError(503, "The server shut down before this request finished"), CLOSE)
        except Exception as e:  # noqa: BLE001  a bug of ours: answered, logged, connection kept
            log.error("internal error on %s %s:\n%s", scope["method"], scope["path"], traceback.format_exc())
            if started:
                raise  # half a response was sent: only closing the connection ends it
            await _send_error(send, APIError(500, f"internal error: {type(e).__name__}: {e}"))

    def _authorized(self, scope) -> bool:
        value = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key)

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None when the client left or an error was sent instead."""
        too_large = APIError(413, f"The request body is larger than this server's limit of {self.max_body} bytes "
                                  f"(--max-request-bytes)")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _send_error(send, too_large)
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                await _send_error(send, APIError(408, f"The request body did not arrive within {self.read_timeout:g} "
                                                      f"seconds of its headers"), CLOSE)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _send_error(send, too_large)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """An ASGI receive that hands out `body` once, then the connection's own messages (a
    disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


def protocol(read_timeout: float):
    """uvicorn's h11 protocol with a header deadline and a shutdown that closes connections whose
    request body is still arriving (module doc)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_too_slow(self) -> None:
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def shutdown(self) -> None:
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and cycle.more_body and not cycle.response_started:
                self.transport.close()  # its body is still arriving: nothing is in flight yet
            else:
                super().shutdown()

    return Protocol
