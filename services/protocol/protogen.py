"""Generate the Python code for protos/ (checked in under services/protocol/pb/).

`python -m services.protocol.protogen` regenerates; tests/protocol/test_protos.py proves the checked-in
code matches protos/. protoc's virtual include path maps protos/ to services/protocol/pb, so the
generated imports come out package-qualified (`from services.protocol.pb.kvfleet.v1 import ...`).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
VIRTUAL = "services/protocol/pb"


def generate(out_dir: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto under protos/ into out_dir.

    protoc runs in a child process: grpc_tools' compiler links its own protobuf/abseil, which
    must not share a process with NIXL's (the process aborts)."""
    protos = sorted(PROTOS.rglob("*.proto"))
    cmd = [sys.executable, "-c", "import sys, grpc_tools, pathlib; from grpc_tools import protoc; "
           "inc = pathlib.Path(grpc_tools.__file__).parent / '_proto'; "
           "sys.exit(protoc.main(['protoc', f'-I{inc}'] + sys.argv[1:]))",
           f"-I{VIRTUAL}={PROTOS}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
           f"--grpc_python_out={out_dir}", *map(str, protos)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed: {done.stderr.strip()}")
    return sorted(p for p in (out_dir / VIRTUAL).rglob("*") if p.is_file())


def main() -> int:
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
