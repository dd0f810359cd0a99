"""Where an engine runs: `--device auto|cpu|cuda` (EngineConfig.device) resolved to a torch device.

auto is cuda when torch sees a GPU, else cpu. cuda without one is refused with DeviceUnavailable
(a ValueError naming what torch reports), never a traceback from deep inside the loader: the
CLIs call `check_device` at start and print its message.

What lives on the device (docs/engine.md, "Device"): the model's weights, the paged KV cache
(the engine core process allocates it there; a CPU cache stays the /dev/shm file the worker maps),
the batch inputs and attention metadata, and the logits the sampler reads. Seeded requests keep
their CPU generators, so a seed draws the same numbers on either device.
"""
from __future__ import annotations

import torch

from services.engine.config import DEVICES


class DeviceUnavailable(ValueError):
    """--device cuda on a machine where torch sees no GPU."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda -> the torch device an engine runs on (cuda: the process's current GPU,
    i.e. index 0 of CUDA_VISIBLE_DEVICES)."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r} ({'|'.join(DEVICES)})")
    if name == "auto":
        name = "cuda" if cuda_available() else "cpu"
    if name == "cuda":
        if not cuda_available():
            raise DeviceUnavailable(
                f"--device cuda: torch {torch.__version__} sees no CUDA GPU "
                f"(built with CUDA {torch.version.cuda or 'none'}); use --device cpu or auto")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device(name: str | None, prog: str) -> None:
    """A CLI's start-up check: exits (status 1) with one line, no traceback, when `name` cannot
    run here."""
    if name is None:
        return
    try:
        resolve_device(name)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}") from None
