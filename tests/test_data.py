"""Dataset loading: every local format, the columns mapping, limits, and the errors for bad files."""

from __future__ import annotations

import json

import pytest

from kitcli.data.rows import fingerprint, read_rows, require_columns
from kitcli.errors import KitError

ROWS = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]


@pytest.fixture(params=["jsonl", "json", "json-data", "csv", "parquet"])
def data_file(request, tmp_path):
    import pandas as pd

    kind = request.param
    path = tmp_path / f"rows.{kind.split('-')[0]}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")  # a blank line is skipped
    elif kind == "json":
        path.write_text(json.dumps(ROWS))
    elif kind == "json-data":
        path.write_text(json.dumps({"data": ROWS}))
    elif kind == "csv":
        pd.DataFrame(ROWS).to_csv(path, index=False)
    else:
        pd.DataFrame(ROWS).to_parquet(path)
    return path


def test_every_format_reads_the_same_rows(data_file):
    rows = read_rows({"path": str(data_file), "columns": {"question": "prompt"}}, "test")
    assert [(r["prompt"], str(r["answer"])) for r in rows] == [("1+1=", "2"), ("2+2=", "4")]


def test_limit_and_fingerprint(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert len(read_rows({"path": str(path), "limit": 1}, "test")) == 1
    first = fingerprint({"path": str(path)})
    path.write_text(json.dumps(ROWS[0]) + "\n")
    assert first.startswith("sha256:") and fingerprint({"path": str(path)}) != first


def test_mapping_a_missing_column_names_the_columns(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(KitError, match=r"no such column \(columns: answer, question\)"):
        read_rows({"path": str(path), "columns": {"query": "prompt"}}, "test")


def test_require_columns_suggests_a_mapping():
    with pytest.raises(KitError) as error:
        require_columns(ROWS, [["prompt", "completion"], ["text"]], "stage 'sft'", "rows.jsonl")
    message = error.value.format_message()
    assert "needs columns prompt+completion or text" in message and "it has answer, question" in message
    assert "columns: {answer: prompt}" in message


def test_bad_json_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"data": [1, 2}')
    with pytest.raises(KitError, match="a.json: not valid JSON"):
        read_rows({"path": str(path)}, "test")


def test_answers_may_be_numbers_or_lists_and_text_must_be_text(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "a", "answer": 4}, {"prompt": "b", "answer": 2.5}, {"prompt": "c", "answer": ["7", 7]},
            {"prompt": [{"role": "user", "content": "d"}], "answer": "x"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [r["answer"] for r in read_rows({"path": str(path)}, "test")] == [4, 2.5, ["7", 7], "x"]
    path.write_text('{"prompt": "a", "answer": 4}\n{"prompt": 5, "answer": 4}\n')
    with pytest.raises(KitError, match=r"test: row 2 of '.*d.jsonl', column 'prompt' holds int 5; it must be a "
                                       r"string or a list of messages"):
        read_rows({"path": str(path)}, "test")


def test_word_problem_splits_share_no_number_pair():
    """smol-grpo's settings are chosen on the validation split: none of its (a, b) pairs is in the training file or
    in the held-out set the README reports, and the prompts GRPO reads hold neither split's pairs nor a question of
    SFT's (the shipped files are what kitcli/data/synthetic.py writes: see tests/test_tool_recipe.py)."""
    from helpers import DATA

    def pairs(name: str) -> set[tuple[int, int]]:
        rows = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
        return {tuple(int(w) for w in row["question"].split() if w.isdigit())[:2] for row in rows}

    train, held_out = pairs("word_problems_train.jsonl"), pairs("word_problems_eval.jsonl")
    validation = pairs("word_problems_validation.jsonl")
    assert len(validation) > 50 and not validation & train and not validation & held_out and not train & held_out
    prompts = pairs("word_problems_prompts.jsonl")  # GRPO reads the first 600; SFT the first 400 of train
    assert not prompts & held_out and not prompts & validation

    def questions(name: str, limit: int | None = None) -> set[str]:
        return {json.loads(line)["question"] for line in (DATA / name).read_text().splitlines()[:limit]}

    assert not questions("word_problems_prompts.jsonl", 600) & questions("word_problems_train.jsonl", 400)


@pytest.mark.parametrize("name", ["text", "json", "parquet"])
def test_a_datasets_file_loader_name_is_refused_not_run_on_the_working_directory(name, tmp_path, monkeypatch):
    """`data: text` is not a file and would reach datasets.load_dataset("text"), which reads every file under the
    working directory as lines of text (31 s in a checkout with its .venv, found by the seeded recipe mutations)."""
    from helpers import fails, write_recipe

    (tmp_path / "notes.txt").write_text("a line that is not a dataset row\n")
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "sft", "type": "sft", "data": name}])
    line = fails("run", recipe, "--dry-run")
    assert f"data '{name}' is neither a file here nor a hub dataset" in line and "data/train.jsonl" in line


PIRATE = {"role": "system", "content": "You are a pirate."}


def test_a_stage_system_prompt_replaces_the_rows_own_system_message():
    """SFT rows (messages, or prompt + completion) and GRPO prompts that open with their own system message end with
    exactly one system message, the stage's; rows without one get it put first."""
    from kitcli.data.rows import apply_system_prompt, with_system_prompt

    user, reply = {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}
    rows = [{"messages": [PIRATE, user, reply]}, {"prompt": [PIRATE, user], "completion": "2"},
            {"prompt": "1+1=", "completion": "2"}]
    out = apply_system_prompt(rows, "Answer with a number.", "test", "rows.jsonl")
    stage = {"role": "system", "content": "Answer with a number."}
    assert out[0]["messages"] == [stage, user, reply]
    assert out[1]["prompt"] == [stage, user] and out[2]["prompt"] == [stage, user]
    assert with_system_prompt([PIRATE, user], "Answer with a number.") == [stage, user]  # GRPO's and PPO's prompts


def test_dry_run_shows_the_stage_system_prompt_in_place_of_the_rows(tmp_path):
    from helpers import run_cli, write_recipe

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [PIRATE, {"role": "user", "content": "1+1="},
                                             {"role": "assistant", "content": "2"}]}) + "\n")
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "sft", "type": "sft", "data": str(data),
                                                 "system_prompt": "Answer with a number."}])
    shown = run_cli("run", recipe, "--dry-run").output.split("# row 1 as the model sees it:")[1]
    assert "Answer with a number." in shown and "pirate" not in shown and shown.count("system") == 1
