"""The gateway never imports torch (DESIGN section 3, step 1): importing any of its modules, the
process entry point included, leaves torch out of sys.modules. Each check runs in a fresh
interpreter, since this test process may already hold torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

GATEWAY_MODULES = ("services.gateway.server", "services.gateway.app", "services.gateway.core",
                   "services.gateway.grpc_api", "services.gateway.validation", "services.gateway.model")


def _torch_free(modules: tuple[str, ...]) -> subprocess.CompletedProcess:
    code = (f"import {', '.join(modules)}; import sys; "
            "heavy = [m for m in ('torch', 'services.engine.model') if m in sys.modules]; "
            "assert not heavy, f'imported {heavy}'")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("modules", [GATEWAY_MODULES, ("services.gateway.__main__",)],
                         ids=["gateway-modules", "gateway-main"])
def test_importing_the_gateway_imports_no_torch(modules):
    done = _torch_free(modules)
    assert done.returncode == 0, done.stderr[-2000:]
