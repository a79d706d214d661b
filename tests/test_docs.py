"""The documentation stays true: the generated config page is current, every relative link leads
to a file (and heading) that exists, the README stays short and keeps its Quick start commands."""
from __future__ import annotations

import pathlib
import re
from urllib.parse import unquote

import pytest

from gradpool.app import config_doc
from gradpool.app.config import known_keys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250
# `.ci/run` runs `make test`; the README's Quick start promises these two lines, unchanged.
QUICK_START = (
    "make train    # creates .venv, installs, trains the tiny DeepSeek-V3 model on 2 CPU ranks "
    "under msrun",
    "make test     # creates .venv, installs with the test extra, runs the whole suite (~20-22 min "
    "on 2 cores)",
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+)(?:.+?)\1")
_EXPLICIT_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline markup dropped, lower case, punctuation but ``-``
    and ``_`` removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # [text](target) -> text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
    seen: dict = {}
    out = set()
    text = path.read_text(encoding="utf-8")
    for _, line in _prose_lines(text):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
        out.update(_EXPLICIT_ID.findall(line))
    return out


def links(path: pathlib.Path):
    """(line number, target) of every Markdown link outside code."""
    text = path.read_text(encoding="utf-8")
    for number, line in _prose_lines(text):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            yield number, target


def _relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)     # http:, https:, mailto: ...


def test_config_page_is_generated_from_the_schema():
    page = ROOT / "docs" / "config.md"
    assert page.exists(), f"docs/config.md is missing; write it with `{config_doc.COMMAND}`"
    assert page.read_text(encoding="utf-8") == config_doc.render(), (
        f"docs/config.md is out of date with the config schema; regenerate it with "
        f"`{config_doc.COMMAND}`")


def test_every_config_key_has_a_meaning():
    assert config_doc.undocumented_keys() == [], (
        "describe these keys in gradpool.app.config_doc.MEANINGS (or with a trailing comment on "
        f"their line in the section), then run `{config_doc.COMMAND}`")


def test_the_config_page_names_every_key():
    page = config_doc.render()
    for section, keys in known_keys().items():
        assert f"## {section}\n" in page
        for key in keys:
            assert f"| `{section}.{key}` |" in page, f"{section}.{key} missing from the page"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(path):
    broken = []
    for number, target in links(path):
        if not _relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}); move details into docs/")


def test_readme_keeps_the_quick_start_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    for command in QUICK_START:
        assert command in lines, f"the README's Quick start lost {command!r}"


def test_the_docs_pages_are_linked_from_the_readme():
    targets = {target.partition("#")[0] for _, target in links(README)}
    for page in ("design.md", "using-fully-shard.md", "checkpoints.md", "config.md", "launch.md",
                 "plan.md", "testing.md", "benchmarks/README.md"):
        assert f"docs/{page}" in targets, f"README.md has no link to docs/{page}"


def test_slug_follows_github():
    assert slug("Using `fully_shard`") == "using-fully_shard"
    assert slug("HSDP: a 2-D mesh (replicate x shard)") == "hsdp-a-2-d-mesh-replicate-x-shard"
    assert slug("Op launch on CPU") == "op-launch-on-cpu"
