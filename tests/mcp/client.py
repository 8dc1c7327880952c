#!/usr/bin/env python3
"""Scenario-driven MCP client for idemproxy's `protocol = "mcp"` integration tests.

A real MCP client from the official Python SDK (`mcp` 2.x: `mcp.Client` over
`mcp.client.streamable_http.streamable_http_client`). It runs a JSON scenario
and prints ONE JSON document on stdout: a list with one entry per step.

    python3 tests/mcp/client.py --url http://127.0.0.1:PORT/mcp \
        --scenario '[{"op":"list_tools"},{"op":"call","tool":"send_email","arguments":{...}}]'

--scenario also accepts @FILE or - (stdin).

Steps (every entry of the output echoes "op" and, if given, "label"):
  {"op":"list_tools","cursor":C?}       -> {"tools":[...], "result_fields":{nextCursor,_meta,...}}
  {"op":"call","tool":T,"arguments":{..},
   "progress":true, "timeout":S}         -> {"result": CallToolResult as wire JSON}
                                            or {"error": {"type","message","code","data"}}
                                            (+ "progress": [{progress,total,message}] if asked)
  {"op":"raw","method":M,"params":{..}}  -> {"result": raw JSON-RPC result dict, unvalidated}
                                            (the session's headers/_meta stamping still applies)
  {"op":"parallel","steps":[...]}        -> {"results":[...]} sub-steps run concurrently
                                            on the current session (same JSON-RPC stream)
  {"op":"new_session", "protocol_version":V?}
                                         -> close the session (DELETE in stateful legacy mode)
                                            and open a brand-new one: new HTTP client, new
                                            JSON-RPC dispatcher (ids restart at 1)
  {"op":"close"}                         -> close the session; the next step opens a new one
  {"op":"info"}                          -> negotiated protocol_version, session_id,
                                            server_info, capabilities
  {"op":"sleep","ms":N}

Any step failing records {"error": ...} and the scenario continues. Every entry
also has "elapsed_ms". Exit code: 0 unless the scenario itself is malformed.

--protocol-version V selects how the client connects:
  2024-11-05 | 2025-03-26 | 2025-06-18 | 2025-11-25 (default)
      handshake era: `initialize` offering V, `notifications/initialized`,
      Mcp-Session-Id if the server issues one, DELETE on close.
  2026-07-28
      modern era, pinned (Client(mode="2026-07-28")): no handshake, no probe,
      every request self-describing (_meta envelope + MCP-Protocol-Version,
      Mcp-Method, Mcp-Name headers).
  auto
      the SDK default (Client(mode="auto")): probe `server/discover` at
      2026-07-28, fall back to `initialize` if the server is legacy-only.

--wire-log FILE appends one JSON line per HTTP request/response the client
makes (method, url, request headers + JSON body; status + response headers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any

import httpx2
import mcp.client.session as _client_session
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT
from mcp.shared.exceptions import MCPError
from mcp.types import Implementation
from mcp.types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

CLIENT_INFO = Implementation(name="idemproxy-test-client", version="1.0.0")


def dump(model: Any) -> Any:
    """Wire-shaped JSON of an SDK model: camelCase aliases, only the fields that were
    present on the wire (fields the SDK model does not know are dropped by the SDK)."""
    if model is None:
        return None
    if hasattr(model, "model_dump"):
        return model.model_dump(by_alias=True, mode="json", exclude_unset=True)
    return model


def error_entry(exc: BaseException) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, MCPError):
        entry["code"] = exc.code
        entry["message"] = exc.message
        if exc.data is not None:
            entry["data"] = exc.data
    elif isinstance(exc, BaseExceptionGroup):
        entry["exceptions"] = [error_entry(e) for e in exc.exceptions]
    return entry


class WireLog:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.session_id: str | None = None
        self._fh = open(path, "a", encoding="utf-8") if path else None

    def _write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record, sort_keys=True) + "\n")
            self._fh.flush()

    async def on_request(self, request: httpx2.Request) -> None:
        body: Any = None
        try:
            raw = request.content
            body = json.loads(raw) if raw else None
        except Exception:  # streaming or non-JSON body
            body = None
        self._write(
            {
                "t": time.time(),
                "dir": "request",
                "method": request.method,
                "url": str(request.url),
                "headers": dict(request.headers),
                "body": body,
            }
        )

    async def on_response(self, response: httpx2.Response) -> None:
        sid = response.headers.get("mcp-session-id")
        if sid:
            self.session_id = sid
        self._write(
            {
                "t": time.time(),
                "dir": "response",
                "method": response.request.method,
                "status": response.status_code,
                "headers": dict(response.headers),
            }
        )

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


class Runner:
    def __init__(self, url: str, protocol_version: str, timeout: float, wire: WireLog) -> None:
        self.url = url
        self.protocol_version = protocol_version
        self.timeout = timeout
        self.wire = wire
        self.client: Client | None = None
        self.stack: contextlib.AsyncExitStack | None = None

    # -- session lifecycle -------------------------------------------------

    async def open(self, protocol_version: str | None = None) -> Client:
        version = protocol_version or self.protocol_version
        if version == "auto":
            mode = "auto"
        elif version in MODERN_PROTOCOL_VERSIONS:
            mode = version
        elif version in HANDSHAKE_PROTOCOL_VERSIONS:
            mode = "legacy"
        else:
            raise ValueError(f"unknown protocol version {version!r}")
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            http = httpx2.AsyncClient(
                timeout=httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT),
                event_hooks={"request": [self.wire.on_request], "response": [self.wire.on_response]},
                trust_env=False,
            )
            await stack.enter_async_context(http)
            self.wire.session_id = None
            client = Client(
                streamable_http_client(self.url, http_client=http),
                mode=mode,
                client_info=CLIENT_INFO,
                read_timeout_seconds=self.timeout,
                # No client-side response cache: every list_tools goes to the wire.
                cache=None,
            )
            # The SDK's initialize() always offers LATEST_HANDSHAKE_VERSION; to offer an
            # older handshake version we override that module global for the handshake.
            saved = _client_session.LATEST_HANDSHAKE_VERSION
            if mode == "legacy":
                _client_session.LATEST_HANDSHAKE_VERSION = version
            try:
                await stack.enter_async_context(client)
            finally:
                _client_session.LATEST_HANDSHAKE_VERSION = saved
        except BaseException:
            await stack.aclose()
            raise
        self.client = client
        self.stack = stack
        return client

    async def close(self) -> None:
        stack, self.stack, self.client = self.stack, None, None
        if stack is not None:
            await stack.aclose()

    async def ensure(self) -> Client:
        if self.client is None:
            return await self.open()
        return self.client

    # -- steps ---------------------------------------------------------------

    async def run_step(self, step: dict[str, Any]) -> dict[str, Any]:
        op = step.get("op")
        out: dict[str, Any] = {"op": op}
        if "label" in step:
            out["label"] = step["label"]
        started = time.monotonic()
        try:
            await self._dispatch(op, step, out)
        except Exception as exc:  # record and carry on
            out["error"] = error_entry(exc)
        out["elapsed_ms"] = round((time.monotonic() - started) * 1000, 1)
        return out

    async def _dispatch(self, op: Any, step: dict[str, Any], out: dict[str, Any]) -> None:
        if op == "list_tools":
            client = await self.ensure()
            result = await client.list_tools(cursor=step.get("cursor"))
            out["tools"] = [dump(tool) for tool in result.tools]
            # Other top-level result fields (nextCursor, _meta, ttlMs, cacheScope, ...).
            out["result_fields"] = {k: v for k, v in dump(result).items() if k != "tools"}
        elif op == "call":
            client = await self.ensure()
            progress: list[dict[str, Any]] = []

            async def on_progress(value: float, total: float | None, message: str | None) -> None:
                progress.append({"progress": value, "total": total, "message": message, "t": time.time()})

            out["tool"] = step["tool"]
            try:
                result = await client.call_tool(
                    step["tool"],
                    step.get("arguments"),
                    read_timeout_seconds=step.get("timeout"),
                    progress_callback=on_progress if step.get("progress") else None,
                    meta=step.get("meta"),
                )
                out["result"] = dump(result)
            finally:
                if step.get("progress"):
                    out["progress"] = progress
        elif op == "raw":
            client = await self.ensure()
            session = client.session
            data: dict[str, Any] = {"method": step["method"]}
            if step.get("params") is not None:
                data["params"] = json.loads(json.dumps(step["params"]))
            opts: dict[str, Any] = {"timeout": step.get("timeout", self.timeout)}
            session._stamp(data, opts)  # same header/_meta stamping as typed requests
            out["method"] = step["method"]
            out["result"] = await session._dispatcher.send_raw_request(data["method"], data.get("params"), opts)
        elif op == "parallel":
            await self.ensure()
            out["results"] = list(await asyncio.gather(*(self.run_step(s) for s in step["steps"])))
        elif op == "new_session":
            await self.close()
            client = await self.open(step.get("protocol_version"))
            out["protocol_version"] = client.protocol_version
            out["session_id"] = self.wire.session_id
        elif op == "close":
            await self.close()
        elif op == "info":
            client = await self.ensure()
            out["protocol_version"] = client.protocol_version
            out["session_id"] = self.wire.session_id
            out["server_info"] = dump(client.server_info)
            out["capabilities"] = dump(client.server_capabilities)
        elif op == "sleep":
            await asyncio.sleep(float(step.get("ms", 0)) / 1000.0)
        else:
            raise ValueError(f"unknown op {op!r}")


def load_scenario(arg: str) -> list[dict[str, Any]]:
    if arg == "-":
        text = sys.stdin.read()
    elif arg.startswith("@"):
        with open(arg[1:], encoding="utf-8") as f:
            text = f.read()
    else:
        text = arg
    scenario = json.loads(text)
    if not isinstance(scenario, list) or not all(isinstance(s, dict) and "op" in s for s in scenario):
        raise ValueError("scenario must be a JSON list of objects with an 'op' key")
    return scenario


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    scenario = load_scenario(args.scenario)
    wire = WireLog(args.wire_log)
    runner = Runner(args.url, args.protocol_version, args.timeout, wire)
    results: list[dict[str, Any]] = []
    try:
        for step in scenario:
            results.append(await runner.run_step(step))
    finally:
        try:
            await runner.close()
        except Exception as exc:  # a failed DELETE must not lose the results
            print(f"client.py: error while closing: {exc!r}", file=sys.stderr)
        wire.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="e.g. http://127.0.0.1:PORT/mcp")
    parser.add_argument("--scenario", required=True, help="JSON list of steps, @FILE, or - for stdin")
    parser.add_argument(
        "--protocol-version",
        default="2025-11-25",
        help=f"one of {list(HANDSHAKE_PROTOCOL_VERSIONS) + list(MODERN_PROTOCOL_VERSIONS)} or 'auto'",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request read timeout (seconds)")
    parser.add_argument("--wire-log", metavar="FILE", help="append JSON lines describing every HTTP exchange")
    args = parser.parse_args()
    try:
        results = asyncio.run(amain(args))
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"client.py: {exc}", file=sys.stderr)
        sys.exit(2)
    json.dump(results, sys.stdout, indent=None, sort_keys=True)
    sys.stdout.write("\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
