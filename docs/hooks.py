"""mkdocs hooks (mkdocs.yml `hooks`): the API reference's table of config keys, generated from the schema
(`phalanx.config.describe_keys`, what `phalanx train --help` prints) each time the site is built."""

from __future__ import annotations

from typing import Any

MARKER = "<!-- config-keys -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_keys_table() -> str:
    from phalanx.config import describe_keys  # the site's build imports Phalanx only where this page asks

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{key}` | {kind} | `{default!r}` | {_cell(help_)} |" for key, kind, default, help_ in describe_keys()]
    return "\n".join(rows)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, config_keys_table()) if MARKER in markdown else markdown
