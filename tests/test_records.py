"""kitcli/records.py, the one reader of JSONL and the one comparison of recorded settings: a dataset is read
strictly (a bad line is an error naming file and line), a run's own log tolerantly (a line cut by a kill is
skipped); the first difference of two settings names its path and both values."""

from __future__ import annotations

import pytest

from kitcli.errors import KitError
from kitcli.records import first_difference, read_jsonl


def test_a_dataset_line_that_is_not_an_object_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n')
    with pytest.raises(KitError, match=r"d\.jsonl: line 3 is not valid JSON"):
        read_jsonl(path, strict=True)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(KitError, match=r"d\.jsonl: line 2 must be a JSON object, got list"):
        read_jsonl(path, strict=True)


def test_a_log_cut_short_by_a_kill_keeps_its_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []  # not written yet
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"ste')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    with pytest.raises(KitError, match="line 4"):
        read_jsonl(path, strict=True)


def test_first_difference_names_the_path_and_both_values():
    assert first_difference({"a": {"b": 1}, "c": 0}, {"a": {"b": 2}, "c": 1}) == ("a.b", 1, 2)
    assert first_difference({"x": [1, 2]}, {"x": [1, 3]}) == ("x[1]", 2, 3)
    assert first_difference({"x": [1, 2]}, {"x": [1]}) == ("x", [1, 2], [1])
    assert first_difference({"beta": 0.5, "logging_steps": 1}, {"beta": 0.5, "logging_steps": 5},
                            ignore={"logging_steps"}) is None
    assert first_difference({"train": {"logging_steps": 1}}, {"train": {"logging_steps": 5}},
                            ignore={"logging_steps"}) is None
    # a setting a newer kit added with an empty default changes nothing; a set one does
    assert first_difference({"data": {"path": "a"}}, {"data": {"path": "a", "chat": False}}) is None
    assert first_difference({"data": {"path": "a"}}, {"data": {"path": "a", "chat": True}}) == ("data.chat", None, True)
