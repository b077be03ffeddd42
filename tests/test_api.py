"""The Python API: `import xlaopt` starts no JAX, and the README's example runs as written."""
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import command_env

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _fresh(code: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`code` in a new interpreter: the simulated device count is the script's own to set."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=command_env(cpu_only=False))


def test_import_starts_no_jax():
    done = _fresh("import sys, xlaopt; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_readme_example_runs():
    section = README.read_text().split("## The Python API", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "xlaopt.simulated_devices(8)" in example
    done = _fresh(example)
    assert done.returncode == 0, done.stderr[-4000:]
