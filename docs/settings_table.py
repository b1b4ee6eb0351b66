"""Rewrites the settings table of docs/configuration.md from the settings'
declarations (``asgi_generate.config.settings_table``).

Run it after adding or changing a setting::

    .venv/bin/python docs/settings_table.py

tests/server/test_settings.py fails while the page and the code differ.
"""

from __future__ import annotations

import pathlib

from asgi_generate.config import settings_table

PAGE = pathlib.Path(__file__).resolve().parent / "configuration.md"
START = "| variable | flag | default | what |"
END = "\n<!-- end of the generated settings table -->"


def table_span(text: str) -> tuple[int, int]:
    """``(start, end)`` of the generated table in the page's ``text``;
    ValueError when either marker is missing."""
    start = text.index(START)
    return start, text.index(END, start)


def main() -> None:
    text = PAGE.read_text()
    start, end = table_span(text)
    PAGE.write_text(text[:start] + settings_table() + text[end:])


if __name__ == "__main__":
    main()
