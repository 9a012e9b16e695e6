"""tiny-tools' data (kitcli/data/synthetic.py): the shipped files are what the generator writes, the traces carry the
calculator's schema exactly as TRL builds it from the tool, every trace's call is the question's product and its result
is true, the traces that answer with the result rounded down are the demonstrator's habit on small results and score
0, the traces whose call the calculator refuses carry its error as TRL hands it to the model and give up (score 0),
and no held-out or validation product is trained on. (The recipe's learning, over seeds, is a benchmark:
bench/seeds.py tiny-tools.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers import DATA

from kitcli.data.synthetic import CALCULATOR_SCHEMA, FACTORS, MISWRITES_FROM, ROUNDS_BELOW, rounded_down, write_all
from kitcli.models.tool_loop import call_tool
from rewards.builtin import exact_match
from tools.builtin import calculator
from tools.registry import load_tool

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = re.compile(r"^What is (\d+)\*(\d+)\?$")


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def pairs(name: str) -> set[tuple[str, str]]:
    return {PRODUCT.match(row["prompt"][0]["content"]).groups() for row in rows(name)}


def test_the_shipped_data_is_what_the_generator_writes(tmp_path):
    for path in write_all(tmp_path):
        assert path.read_bytes() == (DATA / path.name).read_bytes(), f"{path.name} differs: python -m kitcli.synthetic"


def test_the_traces_carry_the_calculators_own_schema_and_true_calls():
    calculator_tool = load_tool("calculator", ROOT)
    assert calculator_tool.schema == CALCULATOR_SCHEMA
    exact, rounded, miswritten = [], [], []
    for row in rows("tool_traces.jsonl"):
        assert row["tools"] == [CALCULATOR_SCHEMA]
        call, result, answer = row["completion"]
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        if "x" in expression:  # the demonstrator's second habit: a call the calculator refuses, then a give-up
            assert "What is " + expression.replace("x", "*") + "?" == row["prompt"][0]["content"]
            name, error, failed = call_tool(call["tool_calls"][0], {"calculator": calculator_tool.fn})  # as in GRPO
            assert failed and result == {"role": "tool", "name": name, "content": str(error)}
            miswritten.append(row)
            continue
        assert "What is " + expression + "?" == row["prompt"][0]["content"]
        assert result == {"role": "tool", "name": "calculator", "content": calculator(expression)}
        (exact if answer["content"] == result["content"] else rounded).append(row)
    for row in rounded:  # the demonstrator's habit: a small result rounded down, which exact match scores 0
        result, answer = row["completion"][1]["content"], row["completion"][2]["content"]
        assert int(result) < ROUNDS_BELOW and answer == rounded_down(result) == result[:2] + "0000"
        assert exact_match([None], [row["completion"]], answer=[result]) == [0.0]
    small = [row for row in exact + rounded if int(row["completion"][1]["content"]) < ROUNDS_BELOW]
    assert 0.65 < len(rounded) / len(small) < 0.85 and len(exact) >= 2500  # ROUNDS_SHARE 0.75 of them
    first_factors = [int(PRODUCT.match(row["prompt"][0]["content"]).group(1)) for row in miswritten]
    assert min(first_factors) >= MISWRITES_FROM
    large = [row for row in exact + rounded if int(PRODUCT.match(row["prompt"][0]["content"]).group(1))
             >= MISWRITES_FROM]
    assert 0.65 < len(miswritten) / (len(miswritten) + len(large)) < 0.85  # MISWRITES_SHARE 0.75 of them
    for row in miswritten:  # a give-up with no number in it, which exact match scores 0
        a, b = PRODUCT.match(row["prompt"][0]["content"]).groups()
        assert not re.search(r"\d", row["completion"][2]["content"])
        assert exact_match([None], [row["completion"]], answer=[str(int(a) * int(b))]) == [0.0]


def test_no_held_out_or_validation_product_is_trained_on():
    trained = pairs("tool_traces.jsonl") | pairs("tool_prompts.jsonl")
    held_out, validation = pairs("tool_eval.jsonl"), pairs("tool_validation.jsonl")
    assert len(held_out) == len(validation) == 100 and len(trained) == 4400
    low, high = FACTORS
    assert all(low <= int(a) <= high and low <= int(b) <= high for a, b in trained | held_out | validation)
    assert {len(row["answer"]) for row in rows("tool_eval.jsonl") + rows("tool_validation.jsonl")} == {6}
    assert not trained & held_out and not trained & validation and not held_out & validation
