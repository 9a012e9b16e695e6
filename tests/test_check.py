"""`kit check`: the cheap part (real tokenizer of the tiny model, real data; no model loaded) finds cut rows,
completions that cannot fit, a generation prompt that pre-fills a format reward's tag, conversations on a model
without a template, a missing stop token in SFT targets, and its warnings become exit 2 under --strict or
`check: strict`. `--signal` (slow) samples the starting policy and says why groups carry no signal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import DATA, SFT_8_STEPS, fails, run_cli, write_recipe

from kitcli.recipe.load import load_recipe
from kitcli.run.check import check_recipe

GRPO = {"name": "grpo", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
        "train": {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4,
                  "max_completion_length": 4, "save_steps": 50}}


def findings(path: Path) -> dict[tuple[str, str], object]:
    return {(f.stage, f.topic): f for f in check_recipe(load_recipe(str(path)))}


def test_shipped_tiny_recipe_has_no_warning_and_its_figures():
    found = findings(Path("recipes/tiny-grpo.yaml"))
    assert not [f for f in found.values() if f.level == "warn"], [f.line() for f in found.values()]
    steps = found[("grpo", "steps")]
    # 400 prompts x 4 samples / (128 completions per step) = 12.5 steps per epoch; max_steps 80
    assert "12.5 steps per epoch, 80 steps (6.40 epochs)" in steps.figures
    assert "128 completions = 32 prompts x num_generations 4" in found[("grpo", "generation batch")].figures


def test_a_filtered_stage_says_its_epochs_are_counted_before_the_filter():
    found = findings(Path("recipes/smol-grpo.yaml"))
    assert not [f for f in found.values() if f.level == "warn"], [f.line() for f in found.values()]
    # 600 prompts x 4 samples / 32 completions per step = 75 steps per epoch; 60 steps, before the filter
    assert found[("grpo", "steps")].figures.startswith("600 rows, 75 steps per epoch, 60 steps (0.80 epochs) before "
                                                        "the filter, which keeps only the prompts")
    assert "before the filter" not in findings(Path("recipes/tiny-grpo.yaml"))[("grpo", "steps")].figures


def test_all_cut_rows_and_completions_that_cannot_fit_are_flagged(tmp_path):
    from kitcli.run.check import load_tokenizer

    sft = {**SFT_8_STEPS, "train": {**SFT_8_STEPS["train"], "max_length": 12}}
    grpo = {**GRPO, "train": {**GRPO["train"], "max_completion_length": 1}}
    found = findings(write_recipe(tmp_path / "r.yaml", [sft, grpo]))
    whole = found[("sft", "whole rows")]
    tokenizer = load_tokenizer("tiny")
    rows = [json.loads(line) for line in (DATA / "arithmetic_sft.jsonl").read_text().splitlines()]
    texts = [tokenizer.apply_chat_template(r["prompt"] + r["completion"], tokenize=False)
             if isinstance(r["prompt"], list) else r["prompt"] + r["completion"] + tokenizer.eos_token for r in rows]
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    share = sum(n > 12 for n in lengths) / len(lengths)
    assert whole.level == "warn" and f"{share:.0%} of {len(rows)} would be cut" in whole.verdict
    assert f"train.max_length >= {max(lengths)}" in whole.verdict
    answer = found[("grpo", "reference answer + stop token")]
    assert answer.level == "warn" and "100% of 400 cannot fit a correct completion" in answer.verdict


def tiny_copy(tmp_path: Path, template: str | None) -> Path:
    """The tiny model's folder with another chat template (None: none at all)."""
    from kitcli.models.tiny import ensure_tiny_model

    folder = tmp_path / "tiny-copy"
    shutil.copytree(ensure_tiny_model(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_a_generation_prompt_that_opens_think_starves_a_format_reward(tmp_path):
    folder = tiny_copy(tmp_path, THINK_TEMPLATE)
    grpo = {**GRPO, "data": {"path": str(DATA / "arithmetic_prompts.jsonl"), "chat": True},
            "rewards": ["exact_match", {"name": "format", "args": {"tags": ["think", "answer"]}}]}
    found = findings(write_recipe(tmp_path / "r.yaml", [grpo], model={"name": str(folder), "max_seq_length": 128}))
    finding = found[("grpo", "generation prompt")]
    assert finding.level == "warn" and "<think>" in finding.verdict and "'format'" in finding.verdict
    # the same stage without the format reward: a fact, not a warning
    found = findings(write_recipe(tmp_path / "s.yaml", [{**grpo, "rewards": ["exact_match"]}],
                                  model={"name": str(folder), "max_seq_length": 128}))
    assert found[("grpo", "generation prompt")].level == "info"


def test_conversations_on_a_model_without_a_template_and_a_target_without_stop_token(tmp_path):
    bare = tiny_copy(tmp_path / "a", None)
    sft = {**SFT_8_STEPS, "data": {"path": str(DATA / "arithmetic_sft.jsonl"), "chat": True}}
    found = findings(write_recipe(tmp_path / "r.yaml", [sft], model={"name": str(bare), "max_seq_length": 128}))
    assert found[("sft", "chat template")].level == "warn"
    endless = tiny_copy(tmp_path / "b", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                        "{% if add_generation_prompt %}assistant: {% endif %}")
    found = findings(write_recipe(tmp_path / "s.yaml", [sft], model={"name": str(endless), "max_seq_length": 128}))
    assert found[("sft", "stop token in targets")].level == "warn"
    assert findings(write_recipe(tmp_path / "t.yaml", [sft]))[("sft", "stop token in targets")].level == "ok"


def test_strict_turns_warnings_into_exit_2(tmp_path):
    grpo = {**GRPO, "train": {**GRPO["train"], "max_completion_length": 1}}
    path = write_recipe(tmp_path / "r.yaml", [grpo])
    result = run_cli("check", path)
    assert "warning: warn: grpo: reference answer" in result.output
    assert "cannot fit a correct completion" in fails("check", path, "--strict")
    strict = write_recipe(tmp_path / "s.yaml", [grpo], check="strict")
    assert "kit check (strict)" in fails("check", strict)
    assert "kit check (strict)" in fails("run", strict, "--output", tmp_path / "run")  # before any stage
    assert not (tmp_path / "run" / "grpo").exists()
    assert run_cli("check", write_recipe(tmp_path / "ok.yaml", [GRPO]), "--strict").exit_code == 0


def test_bad_input_is_one_line(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", [GRPO])
    assert "--signal 0" in fails("check", path, "--signal", "0")
    assert "filter: keeps prompts" in fails("check", write_recipe(tmp_path / "a.yaml", [{**SFT_8_STEPS,
                                                                                          "filter": {"k": 4}}]))
    for bad, expected in (({"k": 1}, "filter.k must be an integer >= 2"),
                          ({"min_pass": 1.5}, "filter.min_pass must be a number <= 1"),
                          ({"max_pass": -0.1}, "filter.max_pass must be a number >= 0"),
                          ({"min_pass": 0.8, "max_pass": 0.2}, "min_pass 0.8 is above max_pass 0.2")):
        line = fails("check", write_recipe(tmp_path / "b.yaml", [{**GRPO, "filter": bad}]))
        assert expected in line, line


def test_the_pass_rule_of_a_filter(tmp_path):
    """Default: every reward at its best (weights times the top of each declared range); pass_reward: one reward's
    declared maximum or pass_score; a reward without a finite range needs pass_reward and pass_score."""
    rewards = ["exact_match", {"name": "numeric_closeness", "args": {"scale": 2.0}, "weight": 0.5}]
    stage = {**GRPO, "rewards": rewards, "filter": {"k": 4}}
    found = findings(write_recipe(tmp_path / "r.yaml", [stage]))
    assert "pass = weighted total >= 1.5" in found[("grpo", "filter")].verdict
    assert "4 samples x 400 prompts = 1600 completions" in found[("grpo", "filter")].figures
    stage["filter"] = {"k": 4, "pass_reward": "exact_match"}
    assert "pass = exact_match >= 1" in findings(write_recipe(tmp_path / "r.yaml", [stage]))[("grpo", "filter")].verdict
    stage["filter"] = {"k": 4, "pass_reward": "numeric_closeness", "pass_score": 0.5}
    found = findings(write_recipe(tmp_path / "r.yaml", [stage]))
    assert "pass = numeric_closeness >= 0.5" in found[("grpo", "filter")].verdict
    stage["filter"] = {"k": 4, "pass_reward": "nope"}
    assert "filter.pass_reward 'nope' is not one of the stage's rewards" in fails(
        "check", write_recipe(tmp_path / "r.yaml", [stage]))
    (tmp_path / "free.py").write_text("def free(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    stage = {**GRPO, "rewards": ["free.py:free"], "filter": {"k": 4}}
    assert "declares no finite score range" in fails("check", write_recipe(tmp_path / "r.yaml", [stage]))


def test_dry_run_prints_the_cheap_check_as_comments(tmp_path):
    grpo = {**GRPO, "train": {**GRPO["train"], "max_completion_length": 1}}
    output = run_cli("run", write_recipe(tmp_path / "r.yaml", [grpo]), "--dry-run").output
    assert "# kit check: " in output and "#   warn: grpo: reference answer + stop token" in output


@pytest.mark.slow
def test_signal_says_why_groups_carry_no_signal(tmp_path):
    """The tiny base model cannot do sums and max_completion_length 1 cuts every completion: every group has equal
    rewards, and the reason given is truncation."""
    grpo = {**GRPO, "train": {**GRPO["train"], "max_completion_length": 1}}
    result = run_cli("check", write_recipe(tmp_path / "r.yaml", [grpo]), "--signal", "4", "--json")
    report = json.loads(result.output.strip().splitlines()[-1])
    figures = report["signal"]["grpo"]
    assert figures["prompts"] == 4 and figures["k"] == 4
    assert figures["zero_variance_share"] == 1.0 and figures["truncated_share"] >= 0.9
    signal = next(f for f in report["findings"] if f["topic"] == "reward signal")
    assert signal["level"] == "warn" and "cut at max_completion_length" in signal["verdict"]


# --- stages with tools (kitcli/run/tool_check.py) -------------------------------------------------------------------

def test_tool_stages_count_the_schemas_and_the_room_a_call_needs(tmp_path):
    """tiny-tools with the two settings that silently failed while it was tuned: an eval round of 64 new tokens cuts
    the ~83-token calculator call before it closes, and a GRPO cap of 96 makes TRL drop every tool result (no answer,
    reward 0). Figures checked against an independent rendering with the tiny tokenizer."""
    from kitcli.data.synthetic import CALCULATOR_SCHEMA
    from kitcli.run.check import load_tokenizer

    shipped = findings(Path("recipes/tiny-tools.yaml"))
    assert not [f for f in shipped.values() if f.level == "warn"], [f.line() for f in shipped.values()]
    changes = {"grpo": ("train", "max_completion_length", 96), "eval-sft": ("generation", "max_new_tokens", 64)}
    recipe = yaml_copy(Path("recipes/tiny-tools.yaml"), tmp_path / "r.yaml", changes)
    found = findings(recipe)
    tokenizer = load_tokenizer("tiny")
    row = json.loads(Path("examples/data/tool_prompts.jsonl").read_text().splitlines()[0])
    prompt = tokenizer.apply_chat_template(row["prompt"], tools=[CALCULATOR_SCHEMA], tokenize=False,
                                           add_generation_prompt=True)
    answer = row["answer"]
    call = (f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{answer}"}}}}\n</tool_call>'
            f'<|im_end|>\n')
    rest = f"<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    grpo, evaluation = found[("grpo", "one tool call + its result + the answer")], found[("eval-sft", "one tool call")]
    assert grpo.level == "warn" and f">= {count(call + rest)}" in grpo.verdict, grpo.line()
    assert evaluation.level == "warn" and f">= {count(call)}" in evaluation.verdict, evaluation.line()
    with_schemas = found[("grpo", "prompt with tool schemas + 96 new tokens")]
    assert f"max {count(prompt) + 96} tokens" in with_schemas.figures, with_schemas.line()
    sft_prompt = found[("sft", "prompts")]  # the traces' own tools column renders the same system turn
    assert f"max {count(prompt)} tokens" in sft_prompt.figures, sft_prompt.line()


def yaml_copy(source: Path, target: Path, changes: dict[str, tuple[str, str, object]]) -> Path:
    """The recipe with data paths made absolute and one value changed per named stage."""
    import yaml

    tree = yaml.safe_load(source.read_text())
    for stage in tree["stages"]:
        stage["data"] = str(Path(stage["data"]).resolve())
        if stage["name"] in changes:
            section, key, value = changes[stage["name"]]
            stage[section][key] = value
    target.write_text(yaml.safe_dump(tree))
    return target


def test_sft_rows_whose_reply_is_a_tool_call_are_checked_not_crashed_on(tmp_path):
    """A trace split at the call (prompt -> the call turn, which has no content) once raised KeyError in the stop-token
    check; the call turn must be checked like any reply: the template closes it with its stop token."""
    from kitcli.data.synthetic import CALCULATOR_SCHEMA

    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "12*13"}}}]}
    question = [{"role": "user", "content": "What is 12*13?"}]
    data = tmp_path / "calls.jsonl"
    data.write_text(json.dumps({"prompt": question, "completion": [call], "tools": [CALCULATOR_SCHEMA]}) + "\n")
    messages = tmp_path / "messages.jsonl"
    messages.write_text(json.dumps({"messages": question + [call], "tools": [CALCULATOR_SCHEMA]}) + "\n")
    recipe = write_recipe(tmp_path / "r.yaml", [{**SFT_8_STEPS, "data": str(data)},
                                                {**SFT_8_STEPS, "name": "sft-messages", "data": str(messages)}])
    found = findings(recipe)
    for stage in ("sft", "sft-messages"):
        stop = found[(stage, "stop token in targets")]
        assert stop.level == "ok" and "<tool_call>" in stop.figures and "<|im_end|>" in stop.figures, stop.line()


def test_large_data_is_measured_on_an_even_sample_and_says_so(tmp_path):
    """Over 1,000 rows the lengths come from 1,000 evenly spaced rows (a check of 100,000 rows would take minutes);
    the finding says so, and the share cut is estimated over the whole file (the long rows are its last third)."""
    rows = [{"prompt": "What is 3+4?", "completion": "7" * (200 if i >= 2000 else 1)} for i in range(3000)]
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sft = {**SFT_8_STEPS, "data": str(data), "train": {**SFT_8_STEPS["train"], "max_length": 64}}
    found = findings(write_recipe(tmp_path / "r.yaml", [sft]))
    assert found[("sft", "lengths")].figures == "1,000 of 3,000 rows, evenly spaced"
    whole = found[("sft", "whole rows")]
    assert whole.level == "warn" and whole.verdict.startswith("33% of 1000 would be cut"), whole.line()


def test_remembered_renders_and_counts_are_what_the_tokenizer_gives():
    """kit check remembers each text's token count and each conversation's rendering per tokenizer (a dry run of
    several stages, or the seeded mutations, renders each row once): what it returns is the tokenizer's own answer,
    and a changed chat template is rendered again."""
    from kitcli.run.check import Renderer, load_tokenizer

    tokenizer = load_tokenizer("tiny")
    chat = [{"role": "user", "content": "What is 2+3?"}]
    rendered = Renderer(tokenizer).prompt(chat)
    assert rendered == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    texts = [rendered, "5", rendered]
    direct = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    assert Renderer(tokenizer).counts(texts) == direct and Renderer(tokenizer).counts(texts) == direct
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        assert Renderer(tokenizer).prompt(chat) == "What is 2+3?"
    finally:
        tokenizer.chat_template = original
    assert Renderer(tokenizer).prompt(chat) == rendered
