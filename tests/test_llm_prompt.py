"""What the model is shown of a worked example family (`onboarding.generate.llm.prompt`)."""

from __future__ import annotations

from pathlib import Path

from onboarding.generate.llm.prompt import _example, _expand_includes


def test_a_worked_example_shows_its_partials_written_out_not_their_names():
    """rmsnorm's template includes `_col_sum.py.j2` (a shared partial): the model must see its
    code, since it cannot read the file; `_common.py.j2` stays an include, as its answer writes
    it."""
    text = _example("rmsnorm")
    assert '{% include "_col_sum.py.j2" %}' not in text
    assert "_col_sum.py.j2, included here" in text and "end of _col_sum.py.j2" in text
    common = Path(__file__).resolve().parents[1] / "kernel_templates" / "_common"
    first_def = next(ln for ln in (common / "_col_sum.py.j2").read_text().splitlines()
                     if ln.startswith("def "))
    assert first_def in text
    assert '{% include "_common.py.j2" %}' in text


def test_includes_expand_recursively_and_a_cycle_or_a_missing_file_stays_as_written(tmp_path):
    (tmp_path / "a.j2").write_text('A1\n{% include "b.j2" %}\nA2\n')
    (tmp_path / "b.j2").write_text('B1\n  {%- include "a.j2" -%}\n{% include "gone.j2" %}\n')
    out = _expand_includes('top\n{% include "a.j2" %}\nend\n', (tmp_path,))
    assert out.splitlines() == [
        "top", "{#- a.j2, included here: -#}", "A1", "{#- b.j2, included here: -#}", "B1",
        '  {%- include "a.j2" -%}', '{% include "gone.j2" %}', "{#- end of b.j2 -#}", "A2",
        "{#- end of a.j2 -#}", "end"]
