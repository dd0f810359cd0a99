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

from services.engine.config import CUDA_GRAPHS, DEVICES


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


def use_cuda_graphs(setting: str, device: torch.device) -> bool:
    """--cuda-graphs auto | on | off on `device` -> whether decode steps run padded to fixed batch
    sizes (services/engine/model/decode_graphs.py): auto is on where the device is CUDA. On CUDA
    they are captured and replayed as graphs; elsewhere `on` runs the same padded steps eagerly."""
    if setting not in CUDA_GRAPHS:
        raise ValueError(f"unknown cuda_graphs {setting!r} ({'|'.join(CUDA_GRAPHS)})")
    return device.type == "cuda" if setting == "auto" else setting == "on"


def rank_device(kind: str, rank: int) -> torch.device:
    """The device of tensor-parallel rank `rank` when the engine runs on `kind` (cpu | cuda):
    rank r on cuda:r of the GPUs the process sees (CUDA_VISIBLE_DEVICES), NCCL between them;
    every rank on the CPU, gloo between them."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", rank)
    raise ValueError(f"a tensor-parallel rank runs on cpu or cuda, not {kind!r}")


def check_rank_devices(kind: str, world_size: int, gpus: int | None = None) -> None:
    """Refuses tensor parallelism over more CUDA ranks than GPUs (`gpus`: how many the process
    sees; torch's count by default), naming both."""
    if kind != "cuda":
        return
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if world_size > gpus:
        raise DeviceUnavailable(f"tensor parallel size {world_size} on cuda needs {world_size} GPUs "
                                f"(rank r on cuda:r); this process sees {gpus}")


def check_device(name: str | None, prog: str) -> None:
    """A CLI's start-up check: exits (status 1) with one line, no traceback, when `name` cannot
    run here."""
    if name is None:
        return
    try:
        resolve_device(name)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}") from None
