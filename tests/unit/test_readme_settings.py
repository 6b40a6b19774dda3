"""The README's settings table is the one ``worker.ops.cli.settings_table`` generates from the
settings' declaration, so the documentation never drifts from the flags and their defaults."""

from __future__ import annotations

from pathlib import Path

from worker.ops.cli import settings_table

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN = "<!-- settings:begin -->\n"
END = "<!-- settings:end -->\n"


def test_the_readme_settings_table_is_the_generated_one() -> None:
    readme = README.read_text()
    assert readme.count(BEGIN) == 1, f"the README needs one {BEGIN.strip()} marker"
    assert readme.count(END) == 1, f"the README needs one {END.strip()} marker"
    shown = readme.split(BEGIN)[1].split(END)[0]
    expected = settings_table()
    if shown != expected:
        print(f"{BEGIN}{expected}{END}", end="")  # under "Captured stdout", ready to paste
    assert shown == expected, (
        "the README's settings table differs from the declaration: replace the README's lines "
        "from its settings:begin marker to its settings:end marker with the captured stdout"
    )
