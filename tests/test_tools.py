"""The tool library (issue 28, items 1-3): the built-in tools, finding and checking tools and environments, the
guard that turns a failing call into a message, `kit tools`, and the tiny model's tool template (plain chats render
as before, TRL parses its tool calls). Tools in stages: tests/test_tool_stages.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import fails, install_plugin_package, rival_distribution, run_cli
from tool_helpers import copy_plugins, schema_line

from kitcli.errors import KitError
from tools.builtin import calculator, python
from tools.registry import ToolError, guard, load_environment, load_tool, load_tools


@pytest.fixture
def plugins(tmp_path) -> Path:
    return copy_plugins(tmp_path)


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

def test_python_tool_returns_stdout_or_the_error(monkeypatch):
    import functools

    import rewards.sandbox

    # the hang runs to the sandbox's time limit: 1 s here instead of the default 5 s, so make test-fast stays short
    monkeypatch.setattr(rewards.sandbox, "SandboxLimits", functools.partial(rewards.sandbox.SandboxLimits,
                                                                             time_limit=1.0))
    assert python("print(6 * 7)") == "42\n"
    assert "no output" in python("x = 1")
    tool = load_tool("python", Path.cwd()).fn
    with pytest.raises(ToolError, match="python: the code failed: ZeroDivisionError"):
        tool(code="print('before')\n1 / 0")
    started = time.monotonic()
    with pytest.raises(ToolError, match="time limit of 1 s"):
        tool(code="while True: pass")
    assert time.monotonic() - started < 10


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
    site = install_plugin_package(tmp_path_factory.mktemp("extra_tools"), "kit-extra-tools", "kit.tools",
                                  {"shout": "shout"}, '''\
        def shout(text: str) -> str:
            """Say it louder.

            Args:
                text: What to say.
            """
            return text.upper()
        ''')
    monkeypatch.syspath_prepend(str(site))
    tool = load_tool("shout", Path.cwd())
    assert tool.source == "entry point kit_extra_tools:shout" and tool.fn(text="hi") == "HI"
    assert tool.schema["function"]["parameters"]["properties"]["text"]["description"] == "What to say."
    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    listed = run_cli("tools", "list").output
    assert "│ shout " in listed and "kit-extra-tools (kit_extra_tools:shout)" in listed and "Say it louder" in listed


def test_two_packages_claiming_one_tool_name_is_an_error(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(rival_distribution(tmp_path, "kit.tools", "calculator")))
    with pytest.raises(KitError) as error:
        load_tool("calculator", tmp_path, "r.yaml")
    message = error.value.format_message()
    assert message.startswith("r.yaml: tool 'calculator' is registered by more than one package: ")
    assert "rival:calculator (rival)" in message and "tools.builtin:calculator (" in message


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


def test_a_fault_in_an_environments_reset_is_one_line_naming_it(plugins):
    """reset() is the user's code, not a call the model made: its fault stops the stage as one KitError line naming
    the environment (a bare ValueError would end the run in a traceback)."""
    from kitcli.errors import KitError

    cls = load_environment("my_tools.py:ResetFails", plugins)
    with pytest.raises(KitError) as failed:
        cls().reset(level=3)
    assert str(failed.value.message) == ("environment 'my_tools.py:ResetFails' reset() raised ValueError: no level "
                                         "3; fix reset (TRL calls it at the start of each rollout, with the row's "
                                         "columns)")  # the stage that ran it prefixes its own name
    assert load_environment("my_tools.py:Counter", plugins)().reset() is None  # a working reset passes through


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
    assert schema_line(schema) == ("calculator(expression: string): Exact arithmetic on integers and fractions: + - * "
                                   "/ ** and parentheses. expression: The arithmetic to do, e.g. 12*(3+4)/5.\n")
    assert schema_line(schema) + "<|im_end|>" in prompt and prompt.count("Be brief.") == 1
    prefix = tokenizer.apply_chat_template(chat, tools=[schema], add_generation_prompt=True, return_dict=False)
    reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*13"}}\n</tool_call><|im_end|>'
    parsed = parse_response(tokenizer, tokenizer(reply, add_special_tokens=False)["input_ids"], prefix=prefix)
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                      "arguments": {"expression": "12*13"}}}]
    turns = [*chat, {"role": "assistant", "content": "", "tool_calls": parsed["tool_calls"]},
             {"role": "tool", "name": "calculator", "content": "156"}]
    assert tokenizer.apply_chat_template(turns, tools=[schema], tokenize=False).endswith(reply + "\n<|im_start|>tool\n"
                                                                                         "156<|im_end|>\n")


