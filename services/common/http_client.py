"""A minimal HTTP/1.1 SSE client for latency measurements on loopback.

Why not httpx: its async client writes a POST's headers and body separately, and on this machine
that costs ~40 ms per request on loopback (Nagle waiting for the server's delayed ACK; passing
TCP_NODELAY through `socket_options` did not change it). That would be charged to the fleet. This
client sends the request in one write and reads the SSE lines as they arrive.
"""
from __future__ import annotations

import asyncio
import json
import time


async def sse_post(address: str, path: str, body: dict, headers: dict[str, str] | None = None):
    """POST `body` and yield (seconds since send, event dict) per `data:` event until [DONE]."""
    host, port = address.rsplit(":", 1)
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    request = (f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n{extra}Connection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        t0 = time.perf_counter()
        writer.write(request + payload)
        await writer.drain()
        status = (await reader.readline()).split()[1]
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {(await reader.read()).decode()[:300]}")
        async for line in reader:
            if line.startswith(b"data: [DONE]"):
                return
            if line.startswith(b"data: "):
                yield time.perf_counter() - t0, json.loads(line[6:])
    finally:
        writer.close()
