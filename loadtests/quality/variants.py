"""Candidates the gate must tell from their reference, made from a checkpoint dir.

    perturb(src, dst, relative_std)   every tensor plus N(0, (relative_std * rms(w))^2) noise
    truncate(src, dst, num_layers)    only the first `num_layers` decoder layers (config and weights)
    cast(src, dst, dtype)             the weights stored in another dtype ("bfloat16"): a change the
                                      gate should let through

Each copies the tokenizer and config files as they are and writes one model.safetensors (a
Llama-style checkpoint: `model.layers.<i>.` tensor names, `num_hidden_layers` in config.json).
`python -m loadtests.quality.variants {perturb,truncate,cast} SRC DST ARG` does the same from a shell.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def perturb(src: str | Path, dst: str | Path, relative_std: float, seed: int = 1) -> Path:
    gen = torch.Generator().manual_seed(seed)

    def noisy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name in sorted(weights):
            w = weights[name].float()
            noise = torch.randn(w.shape, generator=gen) * relative_std * w.pow(2).mean().sqrt()
            out[name] = (w + noise).to(weights[name].dtype)
        return out

    return _rewrite(src, dst, noisy)


def truncate(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    config = json.loads((Path(src) / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be 1..{config['num_hidden_layers']}, got {num_layers}")

    def first_layers(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: w for name, w in weights.items()
                if (m := _LAYER.match(name)) is None or int(m.group(1)) < num_layers}

    return _rewrite(src, dst, first_layers, num_hidden_layers=num_layers)


def cast(src: str | Path, dst: str | Path, dtype: str) -> Path:
    target = getattr(torch, dtype)
    return _rewrite(src, dst, lambda ws: {n: w.to(target) if w.is_floating_point() else w
                                          for n, w in ws.items()}, torch_dtype=dtype)


def _rewrite(src: str | Path, dst: str | Path,
             change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], **config) -> Path:
    """dst: src's files, the weights passed through `change`, `config` keys set in config.json."""
    src, dst = Path(src), Path(dst)
    if not (src / "model.safetensors").is_file():
        raise ValueError(f"{src} has no model.safetensors (sharded checkpoints are not supported)")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(change(load_file(src / "model.safetensors")), dst / "model.safetensors",
              metadata={"format": "pt"})
    if config:
        data = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**data, **config}, indent=2) + "\n")
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.quality.variants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["perturb", "truncate", "cast"])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("arg", help="perturb: relative std (0.02); truncate: layers kept; cast: dtype")
    a = p.parse_args(argv)
    make = {"perturb": lambda: perturb(a.src, a.dst, float(a.arg)),
            "truncate": lambda: truncate(a.src, a.dst, int(a.arg)),
            "cast": lambda: cast(a.src, a.dst, a.arg)}[a.kind]
    print(make())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
