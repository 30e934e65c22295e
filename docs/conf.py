"""Sphinx configuration: the Markdown pages of docs/ (MyST) and the API reference from the docstrings.

`make docs` builds them with warnings as errors (sphinx-build -W --keep-going -n): a broken link, a
reference to a name that does not exist, or a docstring that does not render fails the build, and so
does a README link to a missing file or heading (`check_readme_links` below)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's fusedoff, with its built extension beside it

import fusedoff  # noqa: E402

project = "fusedoff"
release = version = fusedoff.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # `page.md#a-heading` links, checked like any other
myst_enable_extensions = ["colon_fence"]
html_theme = "alabaster"
html_static_path: list[str] = []

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The docs stand alone (no intersphinx: nothing is fetched), so names of torch and of the standard
# library in signatures have no target here; every fusedoff name must resolve.
nitpick_ignore_regex = [
    ("py:.*", r"(torch|typing|collections|pathlib|enum|dataclasses)(\..*)?"),
    ("py:.*", r"(Tensor|Iterable|Sequence|Callable|Mapping|Path|nn\.Module|Module)"),
    ("py:class", r"(int|float|str|bool|dict|list|tuple|None|object|type)"),
]


def check_readme_links(app) -> None:
    """The README is GitHub's front page, outside this build: check its relative links here."""
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    readme = ROOT / "README.md"
    for number, line in enumerate(readme.read_text().splitlines(), start=1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            path, _, anchor = target.partition("#")
            file = (ROOT / path) if path else readme
            if re.match(r"[a-z]+:", target):
                problem = "a link outside the repository"
            elif not file.exists():
                problem = "a link to a missing file"
            elif anchor and file.suffix == ".md" and anchor not in heading_slugs(file.read_text()):
                problem = "a link to a missing heading"
            else:
                continue
            logger.warning("README.md:%d: %s: %s", number, problem, target)


def heading_slugs(markdown: str) -> set[str]:
    """GitHub's (and MyST's) anchors of a page's headings."""
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def setup(app) -> None:
    app.connect("builder-inited", check_readme_links)
