#!/usr/bin/env python3
"""Test MCP server for idemproxy's `protocol = "mcp"` integration tests.

A real, unmodified MCP server built with the official Python SDK (`mcp` 2.x,
`mcp.server.mcpserver.MCPServer`, formerly FastMCP) and served over Streamable
HTTP at http://127.0.0.1:<port>/mcp.

Tools:
  send_email(to, subject, body)        side-effecting, no annotations
  charge_card(amount, currency, delay_ms=0)
                                       side-effecting (destructiveHint=true,
                                       idempotentHint=false, readOnlyHint=false);
                                       sleeps delay_ms and reports progress while
                                       sleeping when the caller asked for progress
  get_weather(city)                    readOnlyHint=true
  fail_tool(mode="tool_error")         fails: "tool_error"/"crash" give a
                                       CallToolResult with isError=true,
                                       "rpc_error" gives a JSON-RPC error

Every execution is observable without MCP through the --counts JSON file,
rewritten atomically (temp file + rename) whenever something is recorded.
`arguments` holds the RAW `params.arguments` of every tools/call request that
reached the server (captured in middleware, before the SDK validates them and
silently drops unknown keys), so a test can prove `idempotency_key` never
reached the upstream.

Prints `READY <port>` (flushed) on stdout once the socket is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import os
import socket
import sys
import time
from typing import Annotated, Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS, CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel

TOOL_NAMES = ("send_email", "charge_card", "get_weather", "fail_tool")
# Request headers worth recording per tools/call (what the proxy forwarded).
RECORDED_HEADERS = ("mcp-session-id", "mcp-protocol-version", "mcp-method", "mcp-name", "accept")


class State:
    """Per-process execution record, mirrored to the --counts file."""

    def __init__(self, counts_path: str | None) -> None:
        self.counts_path = counts_path
        self.counts: dict[str, int] = {name: 0 for name in TOOL_NAMES}
        self.completed: dict[str, int] = {name: 0 for name in TOOL_NAMES}
        self.email_pairs: dict[tuple[str, str], int] = {}
        self.arguments: list[Any] = []
        self.calls: list[dict[str, Any]] = []
        self.methods: dict[str, int] = {}
        self._seq = 0

    def snapshot(self) -> dict[str, Any]:
        doc: dict[str, Any] = dict(self.counts)
        doc["arguments"] = self.arguments
        doc["completed"] = self.completed
        doc["send_email_pairs"] = [
            {"to": to, "subject": subject, "count": n} for (to, subject), n in self.email_pairs.items()
        ]
        doc["calls"] = self.calls
        doc["methods"] = self.methods
        doc["pid"] = os.getpid()
        return doc

    def flush(self) -> None:
        if not self.counts_path:
            return
        self._seq += 1
        directory = os.path.dirname(os.path.abspath(self.counts_path))
        tmp = os.path.join(directory, f".{os.path.basename(self.counts_path)}.{os.getpid()}.{self._seq}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.snapshot(), f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.counts_path)


STATE = State(None)


# ---------------------------------------------------------------------------
# Middleware: sees every inbound message with its RAW params (before the SDK
# validates tool arguments, which silently ignores unknown keys).
# ---------------------------------------------------------------------------


async def recording_middleware(ctx: Any, call_next: Any) -> Any:
    STATE.methods[ctx.method] = STATE.methods.get(ctx.method, 0) + 1
    if ctx.method == "tools/call" and ctx.request_id is not None:
        params = ctx.params if isinstance(ctx.params, dict) else {}
        raw_args = params.get("arguments")
        STATE.arguments.append(copy.deepcopy(raw_args) if raw_args is not None else {})
        headers: dict[str, str] = {}
        request = getattr(ctx, "request", None)
        req_headers = getattr(request, "headers", None)
        if req_headers is not None:
            for name in RECORDED_HEADERS:
                value = req_headers.get(name)
                if value is not None:
                    headers[name] = value
        STATE.calls.append(
            {
                "tool": params.get("name"),
                "arguments": copy.deepcopy(raw_args),
                "request_id": ctx.request_id,
                "protocol_version": ctx.protocol_version,
                "meta_keys": sorted((params.get("_meta") or {}).keys()),
                "headers": headers,
                "t": time.time(),
            }
        )
    STATE.flush()
    return await call_next(ctx)


def begin(tool: str) -> int:
    STATE.counts[tool] += 1
    STATE.flush()
    return STATE.counts[tool]


def finish(tool: str) -> None:
    STATE.completed[tool] += 1
    STATE.flush()


# ---------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------


class SentEmail(BaseModel):
    n: int
    to: str
    subject: str
    n_for_recipient_subject: int


class Charge(BaseModel):
    n: int
    charge_id: str
    amount: int
    currency: str


class Weather(BaseModel):
    city: str
    forecast: str
    temperature_c: int


def build_server() -> MCPServer:
    mcp = MCPServer(
        "idemproxy-test-server",
        version="1.0.0",
        instructions="Test server for idemproxy MCP integration tests.",
        middleware=[recording_middleware],
        log_level="WARNING",
    )

    @mcp.tool(description="Send an email. Side-effecting: every call sends one more email.")
    async def send_email(to: str, subject: str, body: str) -> Annotated[CallToolResult, SentEmail]:
        n = begin("send_email")
        key = (to, subject)
        STATE.email_pairs[key] = STATE.email_pairs.get(key, 0) + 1
        result = SentEmail(n=n, to=to, subject=subject, n_for_recipient_subject=STATE.email_pairs[key])
        finish("send_email")
        return CallToolResult(
            content=[TextContent(type="text", text=f"sent email #{n} to {to}")],
            structured_content=result.model_dump(mode="json"),
        )

    @mcp.tool(
        description="Charge a card. Side-effecting. delay_ms makes the call take that long "
        "(progress is reported while waiting when the caller sent a progressToken).",
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False),
    )
    async def charge_card(
        amount: int, currency: str, ctx: Context, delay_ms: int = 0
    ) -> Annotated[CallToolResult, Charge]:
        n = begin("charge_card")
        if delay_ms > 0:
            steps = max(1, min(5, delay_ms // 20))
            await ctx.report_progress(0, steps, f"charging {amount} {currency}")
            for i in range(1, steps + 1):
                await asyncio.sleep(delay_ms / 1000.0 / steps)
                await ctx.report_progress(i, steps, f"step {i}/{steps}")
        result = Charge(n=n, charge_id=f"ch_{n}", amount=amount, currency=currency)
        finish("charge_card")
        return CallToolResult(
            content=[TextContent(type="text", text=f"charged {amount} {currency} (charge #{n}, id ch_{n})")],
            structured_content=result.model_dump(mode="json"),
        )

    @mcp.tool(
        description="Get the weather for a city. Read-only.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def get_weather(city: str) -> Weather:
        begin("get_weather")
        result = Weather(city=city, forecast="sunny", temperature_c=21)
        finish("get_weather")
        return result

    @mcp.tool(
        description="Always fails. mode=tool_error (default): isError result with the message; "
        "mode=crash: isError result with a generic message; mode=rpc_error: JSON-RPC error response.",
        structured_output=False,
    )
    async def fail_tool(mode: str = "tool_error") -> str:
        n = begin("fail_tool")
        finish("fail_tool")
        if mode == "rpc_error":
            raise MCPError(code=INVALID_PARAMS, message=f"fail_tool rpc error #{n}", data={"n": n})
        if mode == "crash":
            raise RuntimeError(f"fail_tool crashed #{n}")  # text stays server-side
        raise ToolError(f"fail_tool failed #{n}")

    return mcp


async def serve(args: argparse.Namespace) -> None:
    mcp = build_server()
    security = None
    if args.disable_dns_rebinding_protection:
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    app = mcp.streamable_http_app(
        streamable_http_path="/mcp",
        json_response=args.json_response,
        stateless_http=args.stateless,
        transport_security=security,
        host=args.host,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level=args.log_level.lower(),
        access_log=args.access_log,
        lifespan="on",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.005)
        STATE.flush()
        sys.stdout.write(f"READY {port}\n")
        sys.stdout.flush()

    announcer = asyncio.create_task(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0 = pick a free one; see READY line)")
    parser.add_argument("--json-response", action="store_true", help="answer POSTs with application/json, not SSE")
    parser.add_argument("--stateless", action="store_true", help="no Mcp-Session-Id sessions (stateless_http)")
    parser.add_argument("--counts", metavar="FILE", help="JSON file rewritten atomically after every execution")
    parser.add_argument(
        "--disable-dns-rebinding-protection",
        action="store_true",
        help="accept any Host/Origin header (by default only 127.0.0.1/localhost/[::1] are accepted)",
    )
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--access-log", action="store_true", help="uvicorn access log on stderr")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    STATE.counts_path = args.counts
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
