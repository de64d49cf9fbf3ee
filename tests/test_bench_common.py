"""bench.common's page writing: a section between markers replaced in place, a trial run's new page
written whole, a page without the markers refused (pure and fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import write_between_markers

BEGIN, END = "<!-- rows: begin -->", "<!-- rows: end -->"


def test_the_section_is_replaced_and_the_rest_of_the_page_kept(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nprose\n{BEGIN}\nold table\n{END}\n\nmore prose\n")
    write_between_markers(page, BEGIN, END, "new table")
    assert page.read_text() == f"# Title\n\nprose\n{BEGIN}\nnew table\n{END}\n\nmore prose\n"


def test_a_page_not_there_yet_is_written_with_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "trial" / "page.md"  # --out into a new folder, as a trial run writes
    write_between_markers(page, BEGIN, END, "the table")
    assert page.read_text() == f"{BEGIN}\nthe table\n{END}\n"
    write_between_markers(page, BEGIN, END, "again")  # and a second run replaces its section
    assert page.read_text() == f"{BEGIN}\nagain\n{END}\n"


def test_a_page_without_the_markers_is_refused_and_kept(tmp_path: Path) -> None:
    page = tmp_path / "notes.md"
    page.write_text("someone's notes\n")
    with pytest.raises(SystemExit, match="lacks the markers"):
        write_between_markers(page, BEGIN, END, "the table")
    assert page.read_text() == "someone's notes\n"


def test_a_folder_given_as_the_page_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=f"cannot read {tmp_path}"):
        write_between_markers(tmp_path, BEGIN, END, "the table")
