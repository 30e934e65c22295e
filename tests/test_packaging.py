"""The package as users get it: an sdist that carries every source it builds from, metadata that asks
for torch>= the oldest supported version and nothing else at run time, and an install beside an
existing (oldest supported) torch that leaves that torch alone and gives a working optimizer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import textwrap
from email.parser import Parser
from pathlib import Path

import pytest

import fusedoff
from tests.helpers import ADAMW_STEPS_AGAINST_TORCH

ROOT = Path(__file__).resolve().parents[1]
# make test-oldest points this at a venv holding the oldest supported torch and the build tools.
OLDEST_VENV = os.environ.get("FUSEDOFF_OLDEST_VENV")


def oldest_torch() -> str:
    """The torch version of constraints-oldest.txt."""
    pins = re.findall(r"^torch==(\S+)", (ROOT / "constraints-oldest.txt").read_text(), flags=re.M)
    assert len(pins) == 1, pins
    return pins[0]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    if not (ROOT / "setup.py").is_file():
        pytest.skip("not a source tree")
    out = tmp_path_factory.mktemp("sdist")
    result = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / result.stdout.strip().splitlines()[-1]


def sdist_members(path: Path) -> tuple[set[str], str]:
    """The sdist's files relative to its top folder, and its PKG-INFO."""
    with tarfile.open(path) as tar:
        top = f"fusedoff-{fusedoff.__version__}/"
        names = {m.name.removeprefix(top) for m in tar.getmembers() if m.isfile()}
        pkg_info = tar.extractfile(top + "PKG-INFO").read().decode()
    return names, pkg_info


def test_sdist_carries_the_sources_the_build_and_the_tests_need(sdist):
    names, _ = sdist_members(sdist)
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / "fusedoff").rglob("*.py")}
    wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}
    wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py")}
    wanted |= {"benchmarks/gpu_suite/image_packages.txt"}
    wanted |= {"setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "constraints.txt", "constraints-oldest.txt"}
    assert any(name.endswith(".h") for name in wanted) and any(name.endswith(".cu") for name in wanted)
    assert wanted - names == set()
    assert not [name for name in names if name.endswith((".so", ".o", ".pyc"))]


def test_metadata_asks_for_the_oldest_torch_and_nothing_pinned(sdist):
    _, pkg_info = sdist_members(sdist)
    metadata = Parser().parsestr(pkg_info)
    assert metadata["Version"] == fusedoff.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    requires = metadata.get_all("Requires-Dist")
    runtime = [r for r in requires if "extra ==" not in r]
    major_minor = ".".join(oldest_torch().split(".")[:2])
    # never torch==: that would replace the user's torch; threadpoolctl (pure Python): the host share's
    # worker sets its own OpenMP threads
    assert runtime == [f"torch>={major_minor}", "threadpoolctl>=3"]
    assert not [r for r in requires if "==" in r.split(";")[0]], requires
    extras = {r.split(";")[0].strip().split(">")[0].split("<")[0] for r in requires if "extra ==" in r}
    assert {"ninja", "tqdm", "matplotlib", "setuptools"} <= extras  # build and demo tools are extras only


@pytest.mark.slow
@pytest.mark.skipif(not OLDEST_VENV, reason="needs FUSEDOFF_OLDEST_VENV, a venv with the oldest supported torch "
                                            "(make test-oldest makes one and runs this)")
def test_sdist_installs_beside_the_oldest_torch_and_steps(sdist, tmp_path):
    """pip install --no-build-isolation of the sdist into a venv that holds the oldest supported torch:
    torch stays as it was, the extension is built ahead of time against it, and an AdamW step on the
    cpu backend matches torch.optim.AdamW's."""
    python = str(Path(OLDEST_VENV).resolve() / "bin" / "python")
    env = {**os.environ, "FUSEDOFF_CUDA": "0"}  # the CUDA build is make test's; this one checks the install
    env.pop("PYTHONPATH", None)

    def run(*args, timeout=120):
        result = subprocess.run([python, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result

    def torch_version() -> str:
        return run("-c", "import torch; print(torch.__version__)").stdout.strip()

    before = torch_version()
    assert before.split("+")[0] == oldest_torch()
    run("-m", "pip", "uninstall", "--yes", "fusedoff")  # a clean start when run again
    install = run("-m", "pip", "install", "--no-build-isolation", str(sdist), timeout=1200)
    assert torch_version() == before
    assert "Uninstalling torch" not in install.stdout and "Successfully installed fusedoff" in install.stdout
    step = run("-c", textwrap.dedent(
        """
        import torch, fusedoff
        from fusedoff import _ext
        assert "site-packages" in fusedoff.__file__, fusedoff.__file__
        assert _ext.load_extension().torch_version == torch.__version__.split("+")[0]
        """
    ) + ADAMW_STEPS_AGAINST_TORCH + 'print("stepped with", torch.__version__, fusedoff.__file__)\n')
    assert "building the native extension" not in step.stderr  # the installed extension, no JIT build
