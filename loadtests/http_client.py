"""A minimal HTTP/1.1 SSE client for latency measurements on loopback.

Why not httpx: its async client writes a POST's headers and body separately, and on this machine
that costs ~40 ms per request on loopback (Nagle waiting for the server's delayed ACK; passing
TCP_NODELAY through `socket_options` did not change it). That would be charged to the fleet. This
client sends the request in one write and reads the SSE lines as they arrive.

`SSEConnection` keeps its connection open between requests (keep-alive), as the OpenAI client and
vLLM's benchmark client do; `sse_post` opens one connection per request.
"""
from __future__ import annotations

import asyncio
import json
import time


class SSEConnection:
    """One keep-alive HTTP/1.1 connection; one request at a time. The response body may be
    chunked (a stream) or have a Content-Length (an error)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> "SSEConnection":
        host, port = self.address.rsplit(":", 1)
        self._reader, self._writer = await asyncio.open_connection(host, int(port))
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None

    async def post(self, path: str, body: dict, headers: dict[str, str] | None = None):
        """POST `body`; yield (seconds since send, event dict) per `data:` event until [DONE]."""
        if self._writer is None:
            await self.open()
        payload = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.address}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                   f"{extra}\r\n").encode()
        reader = self._reader
        t0 = time.perf_counter()
        self._writer.write(request + payload)
        status, response_headers = await _read_head(reader)
        if status != 200:
            text = await _read_body(reader, response_headers)
            await self.close()
            raise RuntimeError(f"HTTP {status}: {text.decode(errors='replace')[:300]}")
        done = False
        try:
            async for line in _chunked_lines(reader):
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: ") and not done:
                    yield time.perf_counter() - t0, json.loads(line[6:])
        finally:
            if not done or response_headers.get("connection") == "close":
                await self.close()       # a response cut short leaves the connection unusable


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return b"".join([line async for line in _chunked_lines(reader)])


async def _chunked_lines(reader: asyncio.StreamReader):
    """The lines of a chunked body, up to and including its last chunk."""
    pending = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()                     # the CRLF after the last chunk
            break
        pending += await reader.readexactly(size)
        await reader.readexactly(2)                     # the chunk's CRLF
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if pending:
        yield pending


async def sse_post(address: str, path: str, body: dict, headers: dict[str, str] | None = None):
    """POST `body` on a connection of its own; yield (seconds since send, event) until [DONE]."""
    connection = SSEConnection(address)
    try:
        async for item in connection.post(path, body, headers):
            yield item
    finally:
        await connection.close()
