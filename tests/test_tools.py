"""Tools for multi-turn GRPO / GSPO (issue 28, items 1-3): the built-in tools, finding and checking tools and
environments, the guard that turns a failing call into a message, `kit tools`, the tiny model's tool template (plain
chats render as before), TRL's tool-calling data format for SFT / DPO, the refusals, and one short real GRPO run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from helpers import DATA, fails, metrics, run_cli, write_recipe

from kitcli.errors import KitError
from tools.builtin import calculator, python
from tools.registry import ToolError, guard, load_environment, load_tool, load_tools

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")  # conversational prompts with an answer column
SMALL_GRPO = {"learning_rate": 1e-3, "max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 2,
              "max_completion_length": 24, "logging_steps": 1, "save_steps": 50}


@pytest.fixture
def plugins(tmp_path) -> Path:
    shutil.copy(Path(__file__).with_name("tool_plugins.py"), tmp_path / "my_tools.py")
    return tmp_path


# --- calculator -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, expected", [
    ("1+2", "3"), ("7/2", "7/2"), ("10/4*2", "5"), ("2**10", "1024"), ("-(3-5)*4", "8"), ("1/3+1/6", "1/2"),
    ("0.1+0.2", "3/10"), ("2**-2", "1/4"), ("(2/3)**2", "4/9"), ("123456789*987654321", "121932631112635269"),
    ("+5 - -5", "10"), ("3 * (4 + 5) / 9", "3")])
def test_calculator_is_exact(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, fragment", [
    ("1/0", "division by zero"), ("0**-1", "division by zero"), ("2**0.5", "not a whole number"),
    ("2**65", "too large"), ("(2**64)**64", "more than 4096 bits"), ("__import__('os').getcwd()", "not arithmetic"),
    ("x + 1", "'x' is not arithmetic"), ("abs(-3)", "not arithmetic"), ("True + 1", "'True' is not arithmetic"),
    ("'a' * 3", "not arithmetic"), ("1 < 2", "not arithmetic"), ("2 % 3", "not arithmetic"), ("1 +", "cannot read"),
    ("9" * 201, "at most 200"), ("", "give an arithmetic expression")])
def test_calculator_refuses(expression, fragment):
    with pytest.raises(ValueError) as refused:
        calculator(expression)
    assert fragment in str(refused.value)


# --- python and search_file -------------------------------------------------------------------------------------

def test_python_tool_returns_stdout_or_the_error():
    assert python("print(6 * 7)") == "42\n"
    assert "no output" in python("x = 1")
    tool = load_tool("python", Path.cwd()).fn
    with pytest.raises(ToolError, match="python: the code failed: ZeroDivisionError"):
        tool(code="print('before')\n1 / 0")
    started = time.monotonic()
    with pytest.raises(ToolError, match="time limit of 5 s"):
        tool(code="while True: pass")
    assert time.monotonic() - started < 20


def test_search_file_reads_only_the_file_the_recipe_names(tmp_path):
    (tmp_path / "notes.txt").write_text("Alpha one\nbeta two\nalpha three\n")
    tool = load_tool({"name": "search_file", "args": {"path": "notes.txt", "max_lines": 1}}, tmp_path).fn
    assert tool(query="ALPHA") == "1: Alpha one\n(1 more lines match)"
    assert tool(query="gamma") == "no line contains 'gamma'"
    with pytest.raises(ToolError, match="non-empty query"):
        tool(query=" ")
    with pytest.raises(KitError, match="needs args: path"):
        load_tool("search_file", tmp_path)
    with pytest.raises(KitError, match="'nope.txt' is not a file"):
        load_tool({"name": "search_file", "args": {"path": "nope.txt"}}, tmp_path)


# --- schemas, plugins, the guard --------------------------------------------------------------------------------

def test_schemas_of_builtins_and_plugins(plugins, tmp_path, monkeypatch):
    from transformers.utils import get_json_schema

    (tmp_path / "notes.txt").write_text("x\n")
    monkeypatch.syspath_prepend(str(plugins))
    loaded = load_tools(["calculator", "python", {"name": "search_file", "args": {"path": "notes.txt"}},
                         {"name": str(plugins / "my_tools.py") + ":lookup", "timeout": 1}], tmp_path)
    assert [t.name for t in loaded] == ["calculator", "python", "search_file", "lookup"]
    for tool in loaded:
        assert get_json_schema(tool.fn) == tool.schema  # what TRL builds from the guarded function
        assert tool.schema["function"]["name"] == tool.name
    assert loaded[0].schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert loaded[3].schema["function"]["parameters"]["required"] == ["key"]
    assert load_tool("my_tools:lookup", tmp_path).fn(key="ab") == "AB"  # module:function


def test_entry_point_plugin(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("extra_tools")
    source = root / "src"
    (source / "kit_extra_tools").mkdir(parents=True)
    (source / "pyproject.toml").write_text(textwrap.dedent("""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "kit-extra-tools"
        version = "0.1.0"
        [project.entry-points."kit.tools"]
        shout = "kit_extra_tools:shout"
        [tool.setuptools]
        packages = ["kit_extra_tools"]
        """))
    (source / "kit_extra_tools" / "__init__.py").write_text(textwrap.dedent('''\
        def shout(text: str) -> str:
            """Say it louder.

            Args:
                text: What to say.
            """
            return text.upper()
        '''))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(root / "site"), str(source)], check=True, capture_output=True, timeout=120)
    monkeypatch.syspath_prepend(str(root / "site"))
    tool = load_tool("shout", Path.cwd())
    assert tool.source == "entry point kit_extra_tools:shout" and tool.fn(text="hi") == "HI"
    assert tool.schema["function"]["parameters"]["properties"]["text"]["description"] == "What to say."
    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    listed = run_cli("tools", "list").output
    assert "│ shout " in listed and "kit-extra-tools (kit_extra_tools:shout)" in listed and "Say it louder" in listed


def test_guard_turns_every_failure_into_a_message():
    def boom(n: int) -> str:
        """Fails.

        Args:
            n: A number.
        """
        if n == 1:
            raise RuntimeError("broken")
        if n == 2:
            raise SystemExit(3)
        if n == 3:
            time.sleep(5)
        if n == 4:
            raise KeyboardInterrupt
        return str(n)

    tool = guard(boom, "boom", timeout=0.5)
    assert tool(n=0) == "0"
    for kwargs, fragment in [({"n": 1}, "boom failed: RuntimeError: broken"), ({"n": 2}, "boom failed: SystemExit"),
                             ({"n": 3}, "longer than its limit of 0.5 s"), ({"m": 1}, "boom got arguments {'m': 1}"),
                             ({}, "missing a required argument: 'n'")]:
        with pytest.raises(ToolError) as failed:
            tool(**kwargs)
        assert fragment in str(failed.value)
    with pytest.raises(KeyboardInterrupt):  # the user's Ctrl-C still stops the run
        tool(n=4)


def test_environment_methods_are_guarded_tools(plugins):
    cls = load_environment("my_tools.py:Counter", plugins)
    env = cls()
    env.reset()
    assert env.add(n=2) == "2" and env.add(n=3) == "5"
    with pytest.raises(ToolError, match="add got arguments"):
        env.add(k=1)
    with pytest.raises(ToolError, match="add failed: TypeError"):
        env.add(n="x")


# --- kit tools --------------------------------------------------------------------------------------------------

def test_kit_tools_list_and_test(plugins, monkeypatch):
    listed = run_cli("tools", "list").output
    for name in ("calculator", "python", "search_file", "expression: str", "path, max_lines"):
        assert name in listed
    assert run_cli("tools", "test", "calculator", "--args", '{"expression": "12*(3+4)/5"}').output.strip() == "84/5"
    failed = run_cli("tools", "test", "calculator", "--args", '{"expression": "1/0"}', expect=1)
    assert "tool failure: calculator: division by zero" in failed.output
    monkeypatch.chdir(plugins)
    shown = run_cli("tools", "test", "my_tools.py:lookup", "--args", '{"key": "ab"}', "--schema").output
    assert '"name": "lookup"' in shown and shown.strip().endswith("AB")
    assert "is not valid JSON" in fails("tools", "test", "calculator", "--args", "{expression: 1}")
    assert "unknown tool 'calculater'" in fails("tools", "test", "calculater")
    assert "Did you mean 'calculator'?" in fails("tools", "test", "calculater")


# --- the tiny model's template ----------------------------------------------------------------------------------

PLAIN_CHATS = [
    [{"role": "user", "content": "Ada has 3 apples and gets 5 more. How many apples does Ada have?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": " spaces \n"}, {"role": "assistant", "content": ""}],
    [{"role": "tool", "content": "156"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"}],
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_the_shipped_template_is_the_one_tiny_py_builds(tiny_tokenizer):
    from kitcli.models.tiny import ASSETS, CHAT_TEMPLATE

    assert (ASSETS / "chat_template.jinja").read_text() == CHAT_TEMPLATE == tiny_tokenizer.chat_template


def test_plain_chats_render_byte_for_byte_as_before(tiny_tokenizer):
    from kitcli.models.tiny import PLAIN_CHAT_TEMPLATE

    for chat in PLAIN_CHATS:
        for generation in (False, True):
            new = tiny_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)
            old = tiny_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation,
                                                     chat_template=PLAIN_CHAT_TEMPLATE)
            assert new == old


def test_tiny_template_renders_tools_and_trl_parses_its_tool_calls(tiny_tokenizer):
    import copy

    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    from kitcli.training.tool_use import check_template

    tokenizer = copy.deepcopy(tiny_tokenizer)
    assert getattr(tokenizer, "response_template", None) is None  # plain stages: TRL decodes completions as before
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    check_template(tokenizer, "tiny", "test")  # attaches the response template
    schema = load_tool("calculator", Path.cwd()).schema
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12*13?"}]
    prompt = tokenizer.apply_chat_template(chat, tools=[schema], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nTools: call one as <tool_call>")
    assert json.dumps(schema["function"]) in prompt and prompt.count("Be brief.") == 1
    prefix = tokenizer.apply_chat_template(chat, tools=[schema], add_generation_prompt=True, return_dict=False)
    reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*13"}}\n</tool_call><|im_end|>'
    parsed = parse_response(tokenizer, tokenizer(reply, add_special_tokens=False)["input_ids"], prefix=prefix)
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                      "arguments": {"expression": "12*13"}}}]
    turns = [*chat, {"role": "assistant", "content": "", "tool_calls": parsed["tool_calls"]},
             {"role": "tool", "name": "calculator", "content": "156"}]
    assert tokenizer.apply_chat_template(turns, tools=[schema], tokenize=False).endswith(reply + "\n<|im_start|>tool\n"
                                                                                         "156<|im_end|>\n")


# --- TRL's tool-calling data format (SFT, DPO) ------------------------------------------------------------------

def tool_row(name: str = "calculator", role: str = "tool", arguments=None, tools: bool = True) -> dict:
    schema = {"type": "function", "function": {"name": "calculator", "description": "Exact arithmetic.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}
    row = {"messages": [{"role": "user", "content": "What is 12*13?"},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                            "name": name, "arguments": arguments or {"expression": "12*13"}}}]},
                        {"role": role, "name": name, "content": "156"},
                        {"role": "assistant", "content": "156"}]}
    return {**row, "tools": [schema]} if tools else row


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


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


# --- refusals: one line, exit 2, before anything loads ----------------------------------------------------------

def grpo(**changes) -> dict:
    stage = {"name": "grpo", "type": "grpo", "data": {"path": PROMPTS, "limit": 8}, "rewards": ["exact_match"],
             "tools": ["calculator"], "train": dict(SMALL_GRPO)}
    return {**stage, **changes}


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
    ({"name": "sft", "type": "sft", "data": PROMPTS, "tools": ["calculator"]}, "only the trainers of grpo, gspo"),
    (grpo(tools=[]) | {"train": {**SMALL_GRPO, "max_tool_calling_iterations": 2}},
     "max_tool_calling_iterations only matters when the model can call tools"),
    (grpo(data={"path": str(DATA / "word_problems_train.jsonl"), "columns": {"question": "prompt"}}),
     "plain-text prompts; set data: {chat: true}"),
    (grpo(filter={"k": 4}), "filter: samples the starting policy without tools"),
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
        assert json.dumps(get_json_schema(tool)["function"]) in rendered
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
