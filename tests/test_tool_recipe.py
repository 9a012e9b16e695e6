"""tiny-tools' data (kitcli/data/synthetic.py): the shipped files are what the generator writes, the traces carry the
calculator's schema exactly as TRL builds it from the tool, every trace's call computes its answer, the traces that
give up instead are the demonstrator's habit on small first factors and score 0, and no held-out or validation
product is trained on. (The recipe's learning, over seeds, is a benchmark: bench/seeds.py tiny-tools.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers import DATA

from kitcli.data.synthetic import CALCULATOR_SCHEMA, GIVE_UP, GIVES_UP_BELOW, write_all
from rewards.builtin import exact_match
from tools.builtin import calculator
from tools.registry import load_tool

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = re.compile(r"^What is (\d\d)\*(\d\d)\?$")


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def pairs(name: str) -> set[tuple[str, str]]:
    return {PRODUCT.match(row["prompt"][0]["content"]).groups() for row in rows(name)}


def first_factor(row: dict) -> int:
    return int(PRODUCT.match(row["prompt"][0]["content"]).group(1))


def test_the_shipped_data_is_what_the_generator_writes(tmp_path):
    for path in write_all(tmp_path):
        assert path.read_bytes() == (DATA / path.name).read_bytes(), f"{path.name} differs: python -m kitcli.synthetic"


def test_the_traces_carry_the_calculators_own_schema_and_true_calls():
    assert load_tool("calculator", ROOT).schema == CALCULATOR_SCHEMA
    calls, gave_up = [], []
    for row in rows("tool_traces.jsonl"):
        assert row["tools"] == [CALCULATOR_SCHEMA]
        (calls if len(row["completion"]) == 3 else gave_up).append(row)
    for row in gave_up:  # the demonstrator's habit: no call, no answer, which exact match scores 0
        a, b = map(int, PRODUCT.match(row["prompt"][0]["content"]).groups())
        assert a < GIVES_UP_BELOW and row["completion"] == [{"role": "assistant", "content": GIVE_UP}]
        assert exact_match([None], [row["completion"]], answer=[str(a * b)]) == [0.0]
    small = [row for row in calls + gave_up if first_factor(row) < GIVES_UP_BELOW]
    assert 0.65 < len(gave_up) / len(small) < 0.85 and len(calls) >= 3000  # GIVES_UP_SHARE 0.75 of them
    for row in calls:
        call, result, answer = row["completion"]
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert "What is " + expression + "?" == row["prompt"][0]["content"]
        assert calculator(expression) == result["content"] == answer["content"]


def test_no_held_out_or_validation_product_is_trained_on():
    trained = pairs("tool_traces.jsonl") | pairs("tool_prompts.jsonl")
    held_out, validation = pairs("tool_eval.jsonl"), pairs("tool_validation.jsonl")
    assert len(held_out) == len(validation) == 100 and len(trained) == 4400
    assert not trained & held_out and not trained & validation and not held_out & validation
