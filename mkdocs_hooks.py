"""MkDocs hooks (mkdocs.yml `hooks:`): make links from docs/ to repository files outside docs/ work on the site.

The pages in docs/ are also read on GitHub, so they link to repository files by relative paths such as
``../benchmarks/results/step_time_cpu.png``. MkDocs only knows files inside ``docs_dir`` and would report
such a link as not found (an error under ``strict``). For every such link whose target is an existing
non-Markdown file of the repository, this hook publishes a copy of the file under ``repo/<path>`` and
points the link there. Links to missing files and to Markdown files outside docs/ are left alone, so
strict mode still reports them.

Docstrings in the package use Sphinx roles (``:class:`X` ``, ``:meth:`~a.B.c` ``), which Markdown leaves
as literal text before the code span; ``on_page_content`` drops the role and, as Sphinx does for ``~``,
shows only the last component of the name.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

PREFIX = "repo"
_LINK = re.compile(r"(\]\()(\.\./[^)\s#]+)")
_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj|const|ref):<code>(~?)([^<]*)</code>")


def _targets(page_src_uri: str, markdown: str, docs_dir: Path, root: Path) -> dict[str, str]:
    """Map each outside-docs link of one page to the repository path of its target."""
    found = {}
    page_dir = (docs_dir / page_src_uri).parent
    for _, link in _LINK.findall(markdown):
        target = (page_dir / link).resolve()
        if target.suffix == ".md" or not target.is_file():
            continue
        try:
            target.relative_to(docs_dir)
            continue                      # inside docs/: MkDocs resolves it itself
        except ValueError:
            pass
        try:
            found[link] = target.relative_to(root).as_posix()
        except ValueError:
            continue                      # outside the repository: leave it to the link check
    return found


def _dirs(config) -> tuple[Path, Path]:
    docs_dir = Path(config["docs_dir"]).resolve()
    return docs_dir, Path(config["config_file_path"]).resolve().parent


def on_files(files, config):
    from mkdocs.structure.files import File

    docs_dir, root = _dirs(config)
    for md in docs_dir.rglob("*.md"):
        src_uri = md.relative_to(docs_dir).as_posix()
        for rel in _targets(src_uri, md.read_text(encoding="utf-8"), docs_dir, root).values():
            uri = f"{PREFIX}/{rel}"
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(root / rel)))
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir, root = _dirs(config)
    targets = _targets(page.file.src_uri, markdown, docs_dir, root)
    if not targets:
        return markdown
    here = posixpath.dirname(page.file.src_uri) or "."

    def repl(m):
        rel = targets.get(m.group(2))
        if rel is None:
            return m.group(0)
        return m.group(1) + posixpath.relpath(f"{PREFIX}/{rel}", here)

    return _LINK.sub(repl, markdown)


def _drop_role(m: re.Match) -> str:
    name = m.group(2)
    if m.group(1):
        name = name.rsplit(".", 1)[-1]
    return f"<code>{name}</code>"


def on_page_content(html, page, config, files):
    return _ROLE.sub(_drop_role, html)
