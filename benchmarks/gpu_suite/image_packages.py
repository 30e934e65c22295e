"""The GPU machine's image as image_packages.txt writes it down: the packages the rehearsal's venv
installs (its requirement lines) and every distribution the image holds (its `#:` lines).

    .venv-gpu-image/bin/python benchmarks/gpu_suite/image_packages.py   # exit 1, naming them, if this python's environment
                                                          # holds a distribution that the image lacks
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

PACKAGES = Path(__file__).resolve().with_name("image_packages.txt")


def normalize(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): Py_CPUInfo and py-cpuinfo are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read(path: Path = PACKAGES) -> tuple[dict[str, str], set[str]]:
    """({name: pinned version} of the requirement lines, {every distribution the image holds})."""
    pinned, image = {}, set()
    for line in path.read_text().splitlines():
        if line.startswith("#:"):
            image.update(normalize(n) for n in line[2:].split())
        elif line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pinned[normalize(name.strip())] = version.strip()
    return pinned, image


def installed() -> dict[str, str]:
    """{name: version} of every distribution this python sees (pip and setuptools included)."""
    return {normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


def not_in_image(image: set[str], present: dict[str, str]) -> list[str]:
    return sorted(f"{name} {version}" for name, version in present.items() if normalize(name) not in image)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", type=Path, default=PACKAGES)
    args = parser.parse_args(argv)
    pinned, image = read(args.packages)
    present = installed()
    extra = not_in_image(image, present)
    differ = sorted(f"{name} {present.get(name, 'absent')} (wanted {version})" for name, version in pinned.items()
                    if present.get(name) != version)
    print(f"python {sys.version.split()[0]}, {len(present)} distributions; {len(pinned)} asked for: "
          + " ".join(f"{name}=={present.get(name, 'absent')}" for name in pinned))
    if differ:
        print(f"not as {args.packages.name} asks: {', '.join(differ)}")
    if extra:
        print(f"NOT IN THE IMAGE: {', '.join(extra)}")
    return 1 if extra or differ else 0


if __name__ == "__main__":
    sys.exit(main())
