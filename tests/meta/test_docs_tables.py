"""The verdict tables users read (docs/sglang.md, docs/vllm.md) say what the tests expect: the
tests re-measure every cell on every run against their EXPECTED tables, and this holds the
documents to those tables, cell by cell, so neither can change without the other."""
import re
import sys

import pytest

from .. import SOURCE, needs_torch

pytestmark = [needs_torch("the release tests' tables import the engines' loaders"),
              pytest.mark.skipif(not (SOURCE / "docs").is_dir(),
                                 reason="the docs travel with a checkout, not in the wheel")]


def _text(path) -> str:
    return (SOURCE / path).read_text()


def _table(path, header: str):
    """``{row label: [cells]}`` of the markdown table whose header row starts with ``header``."""
    lines = _text(path).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"{path}: no table headed {header!r}"
    columns = [c.strip() for c in lines[start].strip("|").split("|")][1:]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(columns, cells[1:]))
    return rows


def _word(cell: str) -> str:
    return re.sub(r"\*|\[\d+\]", "", cell).split()[0].lower() if cell else ""


def test_the_sglang_class_table_is_the_expected_one():
    from ..sglang.test_releases import (
        EXPECTED_CLASSES,
        EXPECTED_HAZARDS,
        EXPECTED_UNREACHABLE,
    )

    rows = _table("docs/sglang.md", "| release | sp-prescatter |")
    assert set(rows) == set(EXPECTED_CLASSES)
    for release, cells in rows.items():
        for key, cell in cells.items():
            word = _word(cell)
            if key in EXPECTED_HAZARDS.get(release, ()):
                assert word == "exposed", (release, key, cell)
            elif key in EXPECTED_CLASSES[release]:
                assert word == "fail", (release, key, cell)
            elif key in EXPECTED_UNREACHABLE.get(release, ()):
                assert word == "unreachable", (release, key, cell)
            else:
                assert word in ("pass", "hardened"), (release, key, cell)


def test_the_sglang_class_records_are_the_code_ones():
    """docs/sglang.md's table of classes: one row per bug class, its public record the one
    its ``BugClass`` carries."""
    from dispatcher.sglang.bug_classes import BUG_CLASSES

    rows = {label.split()[0].strip("`"): cells
            for label, cells in _table("docs/sglang.md", "| class | public record |").items()}
    assert set(BUG_CLASSES) <= set(rows)
    for key, bug in BUG_CLASSES.items():
        assert rows[key]["public record"] == bug.record, key


def test_the_sglang_property_table_is_the_expected_one():
    from ..sglang.test_releases import EXPECTED_PROPERTIES

    rows = _table("docs/sglang.md", "| release | positive |")
    for release, broken in EXPECTED_PROPERTIES.items():
        failing = {column for column, cell in rows[release].items() if _word(cell) == "fail"}
        assert failing == broken, (release, failing, broken)


def test_the_vllm_table_is_the_expected_one():
    from ..vllm.test_releases import EXPECTED, EXPECTED_CROSS_ROUND, TWO_SIDED

    from dispatcher.engines import ENGINES

    labels = _table("docs/vllm.md", "| vLLM release | any |")
    rows = {label.split()[0]: cells for label, cells in labels.items()}
    for label in labels:  # a row on another generation than the pinned one says which
        version = label.split()[0].partition("@")[0]
        on = ENGINES["vllm"].judged_on(version)
        assert (f"(on FlashInfer {on})" in label) == (on != "0.7.2"), label
    for release, regimes in EXPECTED.items():
        failing = {regime for regime, cell in rows[release].items() if _word(cell) == "fail"}
        assert failing == regimes, (release, failing, regimes)
        assert _word(rows[release]["cross-round"]) == EXPECTED_CROSS_ROUND[release]
    for release in TWO_SIDED:
        assert _word(rows[f"{release}@two-sided"]["cross-round"]) == "n/a"


@pytest.mark.parametrize("doc, header", [("docs/sglang.md", "| release | sp-prescatter |"),
                                         ("docs/vllm.md", "| vLLM release | any |")])
def test_a_changed_cell_is_noticed(doc, header, monkeypatch):
    """The comparison can fail: one FAIL turned into pass in the text is caught."""
    text = _text(doc)
    changed = re.sub(r"\*\*FAIL\*\*( no crash)? \[1\]", "pass", text, count=1)
    assert changed != text
    read = _text
    monkeypatch.setattr(sys.modules[__name__], "_text",
                        lambda path: changed if path == doc else read(path))
    with pytest.raises(AssertionError):
        (test_the_sglang_class_table_is_the_expected_one if "sglang" in doc
         else test_the_vllm_table_is_the_expected_one)()
