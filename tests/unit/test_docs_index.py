"""The documentation holds together: every page under docs/ is reachable from the index
(docs/README.md) by relative Markdown links, every relative link in docs/ and the top-level README
names a file that exists, and no committed doc or config records a build machine's absolute path
(where a bench ran, a scratch folder, a checkout)."""

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

from bench.common import miniature  # what the miniature benches share
from support import ROOT

DOCS_DIR = ROOT / "docs"
INDEX = DOCS_DIR / "README.md"
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)[^)]*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")

MACHINE_PATH = re.compile(r"(?<![\w.$/~-])/(?:work|tmp|root|home|Users|scratch)/[^\s`'\"()<>|,;]*")
"""An absolute path under a build machine's usual roots, not part of a longer path
(`/path/to/scratch/x` and `runs/tmp/x` are not one)."""
TEXT_SUFFIXES = (".md", ".json", ".yaml", ".yml", ".txt")
DELIBERATE = {
    ("docs/reliability.md", "/tmp/absolute.tokens.npy"): "a shard member name the loader refuses "
    "(tests/unit/test_untrusted.py): the absolute path is the point",
}
"""(file, path) pairs that name an absolute path on purpose, and why."""


def markdown_links(path: Path) -> list[str]:
    """The targets of the page's inline, image and reference links, outside code."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t.strip("<>") for t in targets]


def local_target(page: Path, target: str) -> Path | None:
    """The file a relative link points to (its #anchor dropped); None for a URL or an anchor
    within the page."""
    if SCHEME.match(target) or target.startswith("#"):
        return None
    return (page.parent / unquote(target.split("#", 1)[0])).resolve()


def pages() -> list[Path]:
    return sorted(DOCS_DIR.rglob("*.md"))


def test_the_index_reaches_every_page_under_docs():
    reached, todo = {INDEX.resolve()}, [INDEX.resolve()]
    while todo:
        page = todo.pop()
        for target in markdown_links(page):
            found = local_target(page, target)
            if found is None or DOCS_DIR.resolve() not in found.parents:
                continue
            if found.is_dir():
                found = found / "README.md"
            if found.suffix == ".md" and found.is_file() and found not in reached:
                reached.add(found)
                todo.append(found)
    missing = [str(p.relative_to(ROOT)) for p in pages() if p.resolve() not in reached]
    assert len(pages()) > 10
    assert not missing, (
        "add these pages to docs/README.md (or link them from a page it reaches):\n"
        + "\n".join(missing)
    )


def test_every_relative_link_names_a_file_that_exists():
    broken = [
        f"{page.relative_to(ROOT)}: ({target})"
        for page in [ROOT / "README.md", *pages()]
        for target in markdown_links(page)
        if (found := local_target(page, target)) is not None and not found.exists()
    ]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def anchors(page: Path) -> Iterator[str]:
    """The #fragments a page's headings answer to, as GitHub makes them: lower case, punctuation
    but `-` and `_` dropped, spaces as `-`, a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_every_anchor_names_a_heading_of_its_page():
    broken = []
    for page in [ROOT / "README.md", *pages()]:
        for target in markdown_links(page):
            if "#" not in target or SCHEME.match(target):
                continue
            found = page if target.startswith("#") else local_target(page, target)
            if found.is_file() and found.suffix == ".md":
                if target.split("#", 1)[1] not in set(anchors(found)):
                    broken.append(f"{page.relative_to(ROOT)}: ({target})")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


def test_anchors_are_githubs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Generation with early exit: a token\n## Downstream tasks (`eval downstream --exit`)\n"
        "```bash\n# not a heading\n```\n## Fixed-K throughput (CPU, 2026-12-01)\n"
        "## Notes\n## Notes\n"
    )
    assert list(anchors(page)) == [
        "generation-with-early-exit-a-token",
        "downstream-tasks-eval-downstream---exit",
        "fixed-k-throughput-cpu-2026-12-01",
        "notes",
        "notes-1",
    ]


def test_the_link_reader_finds_links_and_skips_code():
    """What the two tests above rely on, on a page written for it."""
    page = DOCS_DIR / "page.md"
    text = (
        "See [a](a.md#part), ![fig](img/fig.png 'title'), [b](<with space.md>), [web](https://x.y)"
        ", [here](#anchor) and `[not](code.md)`.\n\n```bash\n[ -f x ] && echo [no](fence.md)\n```"
        "\n[ref]: ../README.md\n"
    )
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = [t.strip("<>") for t in INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)]
    assert targets == ["a.md#part", "img/fig.png", "with space.md", "https://x.y", "#anchor"] + [
        "../README.md"
    ]
    found = [local_target(page, t) for t in targets]
    assert found[0] == (DOCS_DIR / "a.md").resolve() and found[3] is None and found[4] is None


def machine_paths(text: str) -> list[str]:
    return MACHINE_PATH.findall(text)


def test_no_build_machine_paths_in_docs_or_configs():
    files = [
        p
        for folder in (DOCS_DIR, ROOT / "configs")
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.suffix in TEXT_SUFFIXES
    ] + [ROOT / "README.md"]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {hit}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for hit in machine_paths(line)
        if (str(path.relative_to(ROOT)), hit) not in DELIBERATE
    ]
    assert len(files) > 20
    assert not found, (
        "absolute paths of a machine (write them relative to the repository or the run, or as "
        "an obvious placeholder such as /path/to/...):\n" + "\n".join(found)
    )


def test_the_machine_path_pattern():
    assert machine_paths("runs at /work/gen512/hf and `/tmp/ci-clone/runs/x`") == [
        "/work/gen512/hf",
        "/tmp/ci-clone/runs/x",
    ]
    assert machine_paths('"path": "/home/me/x.json", (/Users/me/y) /scratch/a/b') == [
        "/home/me/x.json",
        "/Users/me/y",
        "/scratch/a/b",
    ]
    for fine in ("runs/tmp/x", "/path/to/scratch/runs", "$SCRATCH/runs", "~/work/x", "a/root/b"):
        assert machine_paths(fine) == [], fine


def test_the_benches_write_their_reports_paths_relative(tmp_path):
    """bench/repro_mini and bench/study_mini rewrite `megaloop report`'s list of inputs so: the
    run and result paths under the scratch folder (or the repository) lose that prefix, a path
    that only starts alike or lies elsewhere is kept."""
    work = tmp_path / "work"
    report = tmp_path / "report.md"
    report.write_text(
        f"- run `{work}/runs/a/seed0`\n"
        f"- depth `{work}/measure/a/seed0/depth.json` (model `{work}/runs/a/seed0`)\n"
        f"- run `{work}2/runs/b/seed0` and `/elsewhere{work}/c`\n"
    )
    miniature.relative_paths(report, work)
    assert report.read_text() == (
        "- run `runs/a/seed0`\n"
        "- depth `measure/a/seed0/depth.json` (model `runs/a/seed0`)\n"
        f"- run `{work}2/runs/b/seed0` and `/elsewhere{work}/c`\n"
    )
