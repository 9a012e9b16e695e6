"""Tools in stages (issue 28, items 1-4): TRL's tool-calling data for SFT and DPO, the refusals of a stage with
tools, one short real GRPO run with tools on both trainer families, and an eval stage with tools."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import DATA, fails, metrics, run_cli, write_recipe
from tool_helpers import PROMPTS, SMALL_GRPO, copy_plugins, grpo, schema_line, tool_row, write_rows

from tools.registry import ToolError, load_tool


@pytest.fixture
def plugins(tmp_path) -> Path:
    return copy_plugins(tmp_path)


# --- TRL's tool-calling data format (SFT, DPO) ------------------------------------------------------------------

def test_rewards_score_the_final_answer_of_a_tool_conversation():
    from rewards.builtin import exact_match

    call = {"role": "assistant", "content": "", "tool_calls": tool_row()["messages"][1]["tool_calls"]}
    result = {"role": "tool", "name": "calculator", "content": "156"}
    completions = [[call, result, {"role": "assistant", "content": "156"}],
                   [call, result],  # cut off after the tool answered: the tool's output is not the model's answer
                   [{"role": "assistant", "content": "Let me see. "}, result, {"role": "assistant", "content": "12"}],
                   [{"role": "assistant", "content": "15"}, {"role": "assistant", "content": "6"}]]  # no tools: joined
    assert exact_match(["q"] * 4, completions, answer=["156"] * 4) == [1.0, 0.0, 0.0, 1.0]


def test_tool_rows_keep_their_own_arguments_in_the_dataset():
    from kitcli.data.rows import to_dataset

    other = tool_row()
    other["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"query": "x", "n": 2}
    dataset = to_dataset([tool_row(), other, {**tool_row(), "tools": json.dumps(tool_row()["tools"])}])
    assert dataset[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"expression": "12*13"}
    assert dataset[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"query": "x", "n": 2}
    assert "content" not in dataset[0]["messages"][1] and dataset[0]["tools"] == tool_row()["tools"]
    assert to_dataset([{"prompt": "a", "completion": "b"}]).features["prompt"].dtype == "string"  # as before


def test_sft_and_dpo_keep_the_tools_column(tmp_path):
    from helpers import stage_context

    from kitcli.stages import pairs, sft

    data = write_rows(tmp_path / "d.jsonl", [tool_row()] * 4)
    prompt, reply = tool_row()["messages"][:1], tool_row()["messages"][1:]
    prefs = write_rows(tmp_path / "p.jsonl", [{"prompt": prompt, "chosen": reply, "rejected": reply[-1:],
                                               "tools": tool_row()["tools"]}] * 4)
    stages = [{"name": "sft", "type": "sft", "data": data, "train": {"max_steps": 1}},
              {"name": "dpo", "type": "dpo", "data": prefs, "train": {"max_steps": 1}}]
    recipe = write_recipe(tmp_path / "r.yaml", stages)
    assert "rows: 4" in run_cli("run", recipe, "--dry-run").output
    assert sft.load_rows(stage_context(recipe, "sft", tmp_path / "run"))[0]["tools"] == tool_row()["tools"]
    assert pairs.preference_rows(stage_context(recipe, "dpo", tmp_path / "run"))[0]["tools"] == tool_row()["tools"]


@pytest.mark.slow
def test_sft_trains_on_tool_calling_rows(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [tool_row()] * 8)
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "sft", "type": "sft", "data": data, "train": {
        "max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1, "save_steps": 50}}],
        model={"name": "tiny", "max_seq_length": 512, "dtype": "float32"})
    run_cli("run", recipe, "--output", tmp_path / "run")
    assert [row["loss"] > 0 for row in metrics(tmp_path / "run" / "sft") if "loss" in row] == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("assistant_only", [True, False])
def test_sft_on_tool_traces_can_leave_the_tool_results_out_of_the_loss(tmp_path, assistant_only):
    """With train.assistant_only_loss the tiny template's {% generation %} marks give loss to the assistant's tokens
    only: the call and the answer, not the tool's result, which the model cannot predict (as GRPO's tool mask).
    Without it, the whole completion is trained, tool result included."""
    from helpers import stage_context

    from kitcli.data.rows import to_dataset
    from kitcli.models.backend import load_stage_policy
    from kitcli.stages import sft
    from kitcli.training.trainers import build_trainer

    trace = {"prompt": tool_row()["messages"][:1], "completion": tool_row()["messages"][1:],
             "tools": tool_row()["tools"]}
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "sft", "type": "sft", "data": write_rows(
        tmp_path / "d.jsonl", [trace] * 2), "train": {"max_steps": 1, "assistant_only_loss": assistant_only}}],
        model={"name": "tiny", "max_seq_length": 512, "dtype": "float32"}, lora=False)
    ctx = stage_context(recipe, "sft", tmp_path / "run")
    loaded = load_stage_policy(ctx.model, lora=None, seed=0, init_from=None, log=lambda message: None)
    trainer, _ = build_trainer(ctx.spec, loaded, args=sft.make_config(ctx),
                               train_dataset=to_dataset(sft.load_rows(ctx)), processing_class=loaded.tokenizer,
                               log=lambda message: None, label="sft", where="sft")
    labels = trainer.data_collator([trainer.train_dataset[0]])["labels"][0].tolist()
    trained = loaded.tokenizer.decode([t for t in labels if t != -100])
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*13"}}\n</tool_call><|im_end|>'
    if assistant_only:
        assert trained == call + "156<|im_end|>", trained
    else:
        assert trained == call + "\n<|im_start|>tool\n156<|im_end|>\n<|im_start|>assistant\n156<|im_end|>\n", trained


# --- refusals: one line, exit 2, before anything loads ----------------------------------------------------------

def model_copy(tmp_path: Path, tiny_model_dir: Path, template: str) -> dict:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(template)
    return {"name": str(folder), "max_seq_length": 512, "dtype": "float32"}


def test_a_tools_stage_dry_run_lists_tools_and_iterations(plugins):
    (plugins / "notes.txt").write_text("x\n")
    stage = grpo(tools=["calculator", {"name": "search_file", "args": {"path": "notes.txt"}}],
                 environment="my_tools.py:Counter")
    output = run_cli("run", write_recipe(plugins / "r.yaml", [stage]), "--dry-run").output
    resolved = yaml.safe_load(output.split("(grpo)\n", 1)[1])
    assert resolved["tools"] == ["calculator (entry point tools.builtin:calculator)",
                                 "search_file (entry point tools.builtin:search_file)"]
    assert resolved["environment"] == "my_tools.py:Counter (tools: add)"
    assert resolved["GRPOConfig"]["max_tool_calling_iterations"] == 4


@pytest.mark.parametrize("stage, fragment", [
    (grpo(tools=["my_tools.py:not_a_function"]), "tool 'not_a_function' is an int, not a function"),
    (grpo(tools=["my_tools.py:Counter"]), "tool 'Counter' is a class, not a function"),
    (grpo(tools=["my_tools.py:untyped"]), "parameter 'key' has no type hint"),
    (grpo(tools=["my_tools.py:undocumented"]), "tool 'undocumented' has no docstring"),
    (grpo(tools=["my_tools.py:args_not_described"]), "TRL cannot build its JSON schema"),
    (grpo(tools=["calculator", "my_tools.py:calculator"]), "two tools are named 'calculator'"),
    (grpo(tools=["calculator"], environment="my_tools.py:NoReset"), "environment 'my_tools.py:NoReset' has no reset"),
    (grpo(tools=["my_tools.py:lookup"], environment="my_tools.py:Counter") | {"tools": ["my_tools.py:add"]},
     "my_tools.py' has no 'add' (callables there: Counter, NoReset,"),
    (grpo(tools=["calculater"]), "unknown tool 'calculater'. Did you mean 'calculator'?"),
    (grpo(tools=[{"name": "calculator", "args": {"x": 1}}]), "tool 'calculator' takes no args"),
    (grpo(environment="Counter"), "must be path/to/file.py:Class or module:Class"),
    (grpo(type="rloo"), "a rloo stage cannot use them (TRL 1.15's RLOOTrainer takes no tools)"),
    ({"name": "sft", "type": "sft", "data": PROMPTS, "tools": ["calculator"]},
     "which only grpo, gspo, eval stages support"),
    (grpo(tools=[]) | {"train": {**SMALL_GRPO, "max_tool_calling_iterations": 2}},
     "max_tool_calling_iterations only matters when the model can call tools"),
    (grpo(data={"path": str(DATA / "word_problems_train.jsonl"), "columns": {"question": "prompt"}}),
     "plain-text prompts; set data: {chat: true}"),
    (grpo(filter={"k": 4}, environment="my_tools.py:Counter"), "filter: samples the starting policy with the "
                                                               "stage's tools: but cannot run an environment:"),
])
def test_bad_tool_stages(plugins, stage, fragment):
    line = fails("run", write_recipe(plugins / "r.yaml", [stage]), "--dry-run")
    assert fragment in line, line


@pytest.mark.parametrize("template, fragment", [
    ("PLAIN", "cannot render a tool-calling conversation"),
    ("TINY", "TRL cannot parse tool calls out of"),  # renders them, but TRL does not know it by name
])
def test_a_template_without_tools_is_refused(tmp_path, tiny_model_dir, template, fragment):
    from kitcli.models.tiny import CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE

    model = model_copy(tmp_path, tiny_model_dir, PLAIN_CHAT_TEMPLATE if template == "PLAIN" else CHAT_TEMPLATE)
    line = fails("run", write_recipe(tmp_path / "r.yaml", [grpo()], model=model), "--dry-run")
    assert fragment in line and "remove tools:" in line, line


@pytest.mark.parametrize("template, rows, fragment", [
    ("TINY", "chat", None),  # its assistant turns are marked: TRL masks with it as it is
    ("PLAIN", "chat", "marks no assistant tokens with {% generation %} and TRL has no training variant of it"),
    ("TINY", "text", "needs conversational rows"),
])
def test_assistant_only_loss_is_refused_where_trl_could_not_mask(tmp_path, tiny_model_dir, template, rows, fragment):
    """TRL finds both only after the model has loaded; the kit before anything loads, in one line."""
    from kitcli.models.tiny import CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE

    model = model_copy(tmp_path, tiny_model_dir, PLAIN_CHAT_TEMPLATE if template == "PLAIN" else CHAT_TEMPLATE)
    row = ({"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}
           if rows == "chat" else {"prompt": "2+2?", "completion": "4"})
    stage = {"name": "sft", "type": "sft", "data": write_rows(tmp_path / "d.jsonl", [row] * 2),
             "train": {"max_steps": 1, "assistant_only_loss": True}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage], model=model)
    if fragment is None:
        run_cli("run", recipe, "--dry-run")
    else:
        line = fails("run", recipe, "--dry-run")
        assert fragment in line and "stage 'sft'" in line and "assistant_only_loss: false" in line, line


@pytest.mark.parametrize("row, fragment", [
    (tool_row(role="robot"), "messages[2] has role 'robot'"),
    (tool_row(name="search"), "messages[1] calls tool 'search', which the row's tools column does not define "
                              "(it defines: calculator)"),
    (tool_row(tools=False), "calls tool 'calculator', but the row has no tools column"),
    (tool_row(arguments="not json"), "has arguments None"),
    ({"messages": [{"role": "user", "content": "q", "tool_calls": [{"function": {"name": "x"}}]}]},
     "tool_calls in a user turn"),
    ({**tool_row(), "tools": "nope"}, "column 'tools' is a string that is not JSON"),
])
def test_bad_tool_calling_rows(tmp_path, row, fragment):
    data = write_rows(tmp_path / "d.jsonl", [tool_row(), row])
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "sft", "type": "sft", "data": data}])
    line = fails("run", recipe, "--dry-run")
    assert fragment in line and "row 2 of" in line, line


# --- one short real GRPO run ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_grpo_with_tools_trains_and_renders_the_schema(plugins, trainer_family):
    """Two GRPO steps with the calculator and an environment on the tiny model, with TRL's trainer and with Unsloth's
    generated one: the trainer holds the guarded tools, the prompt it renders carries their schemas, a tool-call reply
    parses into a call that runs, a failing call raises what TRL counts as a failure, and the tool metrics are
    logged."""
    from helpers import stage_context
    from transformers.utils import get_json_schema
    from trl.chat_template_utils import parse_response
    from trl.data_utils import apply_chat_template

    from kitcli.stages import grpo as grpo_stage
    from kitcli.training.tool_use import DEFAULT_ITERATIONS

    stage = grpo(environment="my_tools.py:Counter", train={**SMALL_GRPO, "temperature": 0.7})
    recipe = write_recipe(plugins / "r.yaml", [stage], model={"name": "tiny", "max_seq_length": 512,
                                                              "dtype": "float32"})
    ctx = stage_context(recipe, "grpo", plugins / "run")
    trainer, loaded, config = grpo_stage.build_trainer(ctx, grpo_stage.VARIANTS["grpo"])
    assert type(trainer).__name__ == ("UnslothGRPOTrainer" if trainer_family == "unsloth" else "GRPOTrainer")
    assert config.max_tool_calling_iterations == DEFAULT_ITERATIONS
    assert [t.__name__ for t in trainer.tools] == ["calculator", "add"]
    prompt = trainer.train_dataset[0]["prompt"]
    rendered = apply_chat_template({"prompt": prompt}, trainer.processing_class, tools=trainer.tools)["prompt"]
    for tool in trainer.tools:
        assert schema_line(get_json_schema(tool)) in rendered
    prefix = trainer.processing_class(rendered, add_special_tokens=False)["input_ids"]
    reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*13"}}\n</tool_call><|im_end|>'
    ids = trainer.processing_class(reply, add_special_tokens=False)["input_ids"]
    call = parse_response(trainer._tokenizer, ids, prefix=prefix)["tool_calls"][0]["function"]
    assert trainer.tools[0](**call["arguments"]) == "156"
    with pytest.raises(ToolError, match="division by zero"):  # TRL catches it: {'error': ...}, a counted failure
        trainer.tools[0](expression="1/0")
    trainer.train()
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert trainer.state.global_step == 2 and len(logged) == 2
    assert all("tools/call_frequency" in row and "tools/failure_frequency" in row for row in logged)


# --- eval with tools --------------------------------------------------------------------------------------------

def test_a_tool_call_in_the_eval_loop_is_answered_or_counted_as_failed():
    from kitcli.models.tool_loop import ToolConversation, call_tool

    tools = {"calculator": load_tool("calculator", Path.cwd()).fn}
    call = tool_row()["messages"][1]["tool_calls"][0]
    assert call_tool(call, tools) == ("calculator", "156", False)
    bad = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1/0"}}}
    assert call_tool(bad, tools) == ("calculator", {"error": "calculator: division by zero"}, True)
    assert call_tool({"type": "function", "function": {"name": "nope", "arguments": {}}}, tools)[2]
    ended_on_tool = ToolConversation([{"role": "assistant", "content": "", "tool_calls": [call]},
                                      {"role": "tool", "name": "calculator", "content": "156"}], 1, 0)
    assert ended_on_tool.final_answer == ""
    assert ToolConversation([{"role": "assistant", "content": "9"}]).final_answer == "9"


def eval_stage(**changes) -> dict:
    return {"name": "eval", "type": "eval", "data": {"path": PROMPTS, "limit": 4}, "tools": ["calculator"],
            "generation": {"max_new_tokens": 8}, **changes}


@pytest.mark.parametrize("stage, fragment", [
    (eval_stage(environment="my_tools.py:Counter"), "environment: lets the model call tools while it generates, which "
                                                    "only grpo, gspo stages support; a eval stage cannot use them"),
    (eval_stage(data={"path": str(DATA / "word_problems_train.jsonl"), "columns": {"question": "prompt"}}),
     "plain-text prompts"),
    (eval_stage(tools=["my_tools.py:undocumented"]), "tool 'undocumented' has no docstring"),
    (eval_stage(max_tool_calling_iterations=-1), "max_tool_calling_iterations"),
])
def test_bad_eval_stages_with_tools(plugins, stage, fragment):
    line = fails("run", write_recipe(plugins / "r.yaml", [stage]), "--dry-run")
    assert fragment in line, line


@pytest.mark.slow
def test_an_eval_stage_with_tools_reports_both_runs(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [eval_stage()], model={"name": "tiny", "max_seq_length": 512,
                                                                       "dtype": "float32"})
    run_cli("run", recipe, "--output", tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "eval" / "DONE").read_text())
    for key in ("exact_match", "exact_match_with_tools", "tool_calls_per_problem", "tool_failures",
                "tool_failure_rate"):
        assert key in summary, key
    assert summary["max_tool_calling_iterations"] == 4 and "; with tools: exact match" in summary["headline"]
    samples = [json.loads(line) for line in (tmp_path / "run" / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["with_tools"]["turns"][0]["role"] == "assistant" for s in samples)
    assert sum(s["with_tools"]["calls"] for s in samples) == summary["tool_calls"]


# --- the whole path on a model that calls tools -----------------------------------------------------------------

BROKEN_F = '''
def f(x: str) -> str:
    """F.

    Args:
        x: X.
    """
    if x in ("4", "5"):
        raise RuntimeError("out of order")
    return x + "7"
'''


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    """SFT on 36 traces of one tool call (`f(x)` answers x followed by 7; the right answer is the tool's result),
    then an eval with f, an eval with an f that fails on 4 and 5, and two near-greedy GRPO steps with f, after a
    difficulty filter that keeps every prompt (it samples with f live): the tiny model learns to call the tool in
    150 steps, about 20 s (here: exact match 0/9 without tools, 9/9 with; GRPO's completions all call f and score
    1.0)."""
    root = copy_plugins(tmp_path_factory.mktemp("tool_caller"))
    (root / "broken_tools.py").write_text(BROKEN_F)
    schema = load_tool("my_tools.py:f", root).schema
    trace = [{"messages": [{"role": "user", "content": f"q{d}"},
                           {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                               "name": "f", "arguments": {"x": d}}}]},
                           {"role": "tool", "name": "f", "content": d + "7"},
                           {"role": "assistant", "content": d + "7"}], "tools": [schema]} for d in "123456789"]
    questions = [{"prompt": [{"role": "user", "content": f"q{d}"}], "answer": d + "7"} for d in "123456789"]
    model = {"name": "tiny", "max_seq_length": 512, "dtype": "float32"}
    evaluation = {"type": "eval", "init": "sft", "data": write_rows(root / "q.jsonl", questions),
                  "generation": {"max_new_tokens": 80}}
    recipe = write_recipe(root / "r.yaml", [
        {"name": "sft", "type": "sft", "data": write_rows(root / "sft.jsonl", trace * 4), "train": {
            "learning_rate": 5e-3, "max_steps": 150, "per_device_train_batch_size": 9, "lr_scheduler_type": "constant",
            "logging_steps": 50, "save_steps": 1000}},
        {**evaluation, "name": "eval-tools", "tools": ["my_tools.py:f"]},
        {**evaluation, "name": "eval-broken", "tools": ["broken_tools.py:f"]},
        {"name": "grpo", "type": "grpo", "init": "sft", "data": str(root / "q.jsonl"), "rewards": ["exact_match"],
         "tools": ["my_tools.py:f"], "filter": {"k": 2, "min_pass": 0.0, "max_pass": 1.0},
         "train": {**SMALL_GRPO, "max_completion_length": 128, "temperature": 0.01}}],
        model=model, lora={"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}, seed=1)
    run_cli("run", recipe, "--output", root / "run")
    return root / "run"


@pytest.mark.slow
def test_a_model_that_calls_tools_is_evaluated_with_and_without_them(tool_caller):
    done = json.loads((tool_caller / "eval-tools" / "DONE").read_text())
    assert done["exact_match"] <= 0.2 and done["exact_match_with_tools"] >= 0.6, done
    assert done["tool_calls_per_problem"] >= 0.6 and done["tool_failures"] == 0
    sample = json.loads((tool_caller / "eval-tools" / "samples.jsonl").read_text().splitlines()[0])
    assert [turn["role"] for turn in sample["with_tools"]["turns"]][:2] == ["assistant", "tool"]
    broken = json.loads((tool_caller / "eval-broken" / "DONE").read_text())
    samples = [json.loads(line) for line in (tool_caller / "eval-broken" / "samples.jsonl").read_text().splitlines()]
    failed = [s for s in samples if s["with_tools"]["failures"]]
    assert broken["tool_failures"] == sum(s["with_tools"]["failures"] for s in samples) >= 1
    assert all("f failed: RuntimeError: out of order" in s["with_tools"]["turns"][1]["content"] for s in failed)
    assert broken["tool_failure_rate"] == broken["tool_failures"] / broken["tool_calls"]


@pytest.mark.slow
def test_grpo_makes_and_runs_tool_calls(tool_caller):
    logged = [row for row in metrics(tool_caller / "grpo") if "loss" in row]
    assert len(logged) == 2 and all(row["tools/call_frequency"] >= 0.5 for row in logged), logged
    assert all(row["tools/failure_frequency"] == 0 for row in logged)
    assert max(row["reward"] for row in logged) > 0  # the final answer after the tool turn, scored by exact_match


@pytest.mark.slow
def test_the_difficulty_filter_samples_with_the_tools_live(tool_caller):
    """The model answers q1..q9 only through f (0/9 without it): the GRPO stage's filter and `kit check --signal`,
    sampling with f live, find every prompt passed, and `kit data filter` with an f that fails on 4 and 5 keeps
    exactly those two."""
    record = json.loads((tool_caller / "grpo" / "DONE").read_text())["filter"]
    assert record["prompts"] == record["kept"] == 9 and record["pass_rate_histogram_before"][-1] == 9, record
    assert record["truncated_share_before"] == 0
    checked = run_cli("check", tool_caller.parent / "r.yaml", "--signal", "9", "--output", tool_caller, "--json")
    signal = json.loads(checked.stdout.splitlines()[-1])["signal"]["grpo"]
    assert signal["pass_rate_mean"] == 1.0 and signal["zero_variance_none_passed"] == 0, signal
    kept = tool_caller.parent / "kept.jsonl"
    run_cli("data", "filter", tool_caller.parent / "r.yaml", "grpo", "--output", kept, "--run-dir", tool_caller,
            "--set", "stages.grpo.tools=[broken_tools.py:f]",
            "--set", "stages.grpo.filter={k: 2, min_pass: 0.0, max_pass: 0.5}")
    assert [json.loads(line)["answer"] for line in kept.read_text().splitlines()] == ["47", "57"]


@pytest.mark.slow
def test_sampled_tool_conversations_share_one_token_budget_as_in_trl(tool_caller):
    """As in TRL's tool loop, the rounds share max_completion_length: with room for the call but not for the tool's
    result, the result is dropped and the conversation ends at the call, with no answer."""
    from helpers import stage_context

    from kitcli.models.backend import load_stage_policy
    from kitcli.models.tool_loop import Toolbox, render_ids, sample_with_tools
    from kitcli.training.tool_use import attach_response_template

    ctx = stage_context(tool_caller.parent / "r.yaml", "grpo", tool_caller)
    loaded = load_stage_policy(ctx.model, lora=None, seed=0, init_from=tool_caller / "sft", trainable=False,
                               log=lambda message: None)
    attach_response_template(loaded.tokenizer, "tiny")
    tool = load_tool("my_tools.py:f", tool_caller.parent)
    box, prompt = Toolbox({"f": tool.fn}, [tool.schema], max_iterations=4), [{"role": "user", "content": "q3"}]

    def draw(budget: int) -> list:
        return sample_with_tools(loaded.model, loaded.tokenizer, [prompt], box, n=2, max_new_tokens=budget,
                                 sampling={"temperature": 0.01}, seed=1)[0]

    whole = draw(200)
    assert all([t["role"] for t in turns] == ["assistant", "tool", "assistant"] and turns[-1]["content"] == "37"
               and len(ids) <= 200 and not truncated for turns, ids, truncated in whole), whole
    call = len(render_ids(loaded.tokenizer, prompt, whole[0][0][:1], box.schemas, generation_prompt=False)) - \
        len(render_ids(loaded.tokenizer, prompt, [], box.schemas))
    for turns, ids, truncated in draw(call + 2):
        assert [t["role"] for t in turns] == ["assistant"] and turns[0]["tool_calls"] and not truncated, turns
        assert len(ids) <= call + 2


@pytest.mark.slow
def test_grpo_keeps_its_tool_conversations_for_the_dashboard_and_the_report(tool_caller):
    saved = [json.loads(line) for line in (tool_caller / "grpo" / "completions.jsonl").read_text().splitlines()]
    called = [s for s in saved if s.get("turns")]
    assert called and all(s["turns"][1]["role"] == "tool" and s["tool_calls"] >= 1 for s in called)
    report = (tool_caller / "report.md").read_text()
    assert "Sample conversation at step 2 (" in report and '- **call**: `f(x="' in report
    assert "| tools/call_frequency |" in report


@pytest.mark.slow
def test_kit_chat_with_tools_runs_the_eval_loop(tool_caller):
    from click.testing import CliRunner

    from kitcli.commands.cli import main

    tool = f"{tool_caller.parent / 'my_tools.py'}:f"
    result = CliRunner().invoke(main, ["chat", str(tool_caller / "sft"), "--tools", tool, "--max-new-tokens", "80"],
                                input="q3\n/exit\n")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert 'assistant> calls f(x="3")' in lines and "tool f> 37" in lines and "assistant> 37" in lines, lines
