"""Who may call the server (Access), checked by an ASGI middleware (Guard) before a body is read:
the Host names it answers to, the Origins a browser may call from, the API key, JSON bodies only,
and their declared size."""

import dataclasses
import hmac
from urllib.parse import urlsplit

from tunix_train.serve.schema import BadRequest

LOOPBACK = ("localhost", "127.0.0.1", "::1")


def _host_of(url: str) -> str:
    """'//[::1]:8000' -> '::1', 'https://Example.com:80' -> 'example.com', 'null' -> ''."""
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may call: the Host names the server answers to (DNS rebinding), the Origins a browser
    may call from (cross-site requests), the API key, JSON bodies only, and their size."""

    api_key: str | None = None
    hosts: tuple[str, ...] = LOOPBACK  # "*": any
    origins: tuple[str, ...] = LOOPBACK  # host names of allowed Origin headers; "*": any
    max_body_bytes: int = 2 << 20

    def refusal(self, method: str, path: str, headers: dict[str, str]) -> BadRequest | None:
        if "*" not in self.hosts and _host_of(f"//{headers.get('host', '')}") not in self.hosts:
            return BadRequest(
                f"the Host header {headers.get('host', '')[:80]!r} is not one this server answers to "
                f"(--allowed_hosts)",
                status=403,
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and "*" not in self.origins and _host_of(origin) not in self.origins:
            return BadRequest(
                f"requests from the origin {origin[:80]!r} are not allowed (--allowed_origins)",
                status=403,
                code="origin_not_allowed",
            )
        if self.api_key is not None and path != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return BadRequest(
                    "Incorrect API key provided: send it as 'Authorization: Bearer KEY'",
                    status=401,
                    code="invalid_api_key",
                )
        if method == "POST":
            if headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
                return BadRequest(
                    "the body must be sent as Content-Type: application/json",
                    status=415,
                    code="unsupported_media_type",
                )
            declared = headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
                return BadRequest(
                    f"the body is larger than this server's {self.max_body_bytes} bytes (--max_body_bytes)",
                    status=413,
                    code="body_too_large",
                )
        return None


class Guard:
    """ASGI middleware: a request Access refuses gets its error before the app sees it."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refused = self.access.refusal(scope["method"], scope["path"], headers)
            if refused is not None:
                from fastapi.responses import JSONResponse

                await JSONResponse(refused.body(), refused.status, refused.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)
