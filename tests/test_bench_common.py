"""bench.common's page writing: a section between markers replaced in place, a trial run's new page
written whole, a page without the markers refused (pure and fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import write_between_markers, write_page

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


def test_a_page_that_cannot_be_written_is_kept_and_named_in_one_line(tmp_path: Path) -> None:
    # a bench's --out under a file: the folder cannot be made; its minutes of measurements are not lost
    blocker = tmp_path / "results"
    blocker.write_text("a file where the folder should be\n")
    with pytest.raises(SystemExit) as ended:
        write_page(blocker / "page.md", "| the | table |\n")
    message = str(ended.value)
    assert message.startswith("error: ") and "\n" not in message
    kept = Path(message.rsplit("the page is kept at ", 1)[1])
    assert kept.read_text() == "| the | table |\n" and kept.suffix == ".md"
    kept.unlink()
    # a folder given as the page: write_atomic's own refusal, the page kept the same way
    with pytest.raises(SystemExit, match="cannot write .*; the page is kept at ") as refused:
        write_page(tmp_path, "text")
    Path(str(refused.value).rsplit("the page is kept at ", 1)[1]).unlink()
