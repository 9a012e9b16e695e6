"""Finding rewards, four ways through one mechanism: built-in names, module:function, path/to/file.py:function
(relative to the recipe), and entry points of an installed package (a small test package installed with pip);
factory args from the recipe; errors that name the fix; `kit rewards list` and `kit rewards test`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import DATA, TINY_MODEL, install_plugin_package, rival_distribution, run_cli, write_recipe

from kitcli.errors import KitError
from kitcli.recipe.load import load_recipe
from rewards.registry import check_columns, entry_points, known_rewards, load_reward, load_rewards, required_columns

ROOT = Path(__file__).resolve().parent.parent
BUILTINS = {"exact_match", "math_equal", "format", "tag_credit", "length_penalty", "overlong_penalty",
            "repetition_penalty", "reward_model", "code_exec"}
SAMPLES = ROOT / "examples" / "my_rewards_samples.jsonl"


@pytest.fixture(scope="module")
def extra_rewards_package(tmp_path_factory) -> Path:
    """A third-party package that registers a reward in `kit.rewards`, installed with pip into its own target
    directory (a real distribution with dist-info and entry_points.txt, without touching the shared venv)."""
    site = install_plugin_package(tmp_path_factory.mktemp("extra"), "kit-extra-rewards", "kit.rewards",
                                  {"shouting": "shouting", "prefixed": "prefixed"}, '''\
        from rewards.registry import reward_factory


        def shouting(prompts, completions, **kwargs):
            """1.0 for a completion in capital letters."""
            return [float(str(c).isupper()) for c in completions]


        @reward_factory
        def prefixed(prefix="A:"):
            """1.0 when the completion starts with the prefix."""
            def prefixed_reward(prompts, completions, **kwargs):
                return [float(str(c).startswith(prefix)) for c in completions]
            return prefixed_reward
        ''')
    assert (site / "kit_extra_rewards-0.1.0.dist-info" / "entry_points.txt").is_file()
    return site


@pytest.fixture
def installed(extra_rewards_package, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(extra_rewards_package))
    return extra_rewards_package


def test_builtins_register_through_the_entry_point_group():
    points = entry_points()
    assert set(points) >= BUILTINS
    for name in BUILTINS:
        assert points[name].value == f"rewards.builtin:{name}"
        assert "(lora-kit)" in known_rewards()[name]


def test_builtin_name_with_args_and_weight_from_a_recipe(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [{
        "name": "grpo", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"),
        "rewards": ["exact_match", {"name": "format", "args": {"tags": ["think", "answer"]}, "weight": 0.5},
                    {"name": "length_penalty", "args": {"max_length": 64}, "on_error": "skip"}]}], model=TINY_MODEL)
    stage = load_recipe(str(recipe)).stage("grpo")
    loaded = load_rewards(stage.rewards, tmp_path, "r.yaml: stage 'grpo': rewards")
    assert [r.name for r in loaded] == ["exact_match", "format_think_answer", "length_penalty"]
    assert [r.weight for r in loaded] == [1.0, 0.5, 1.0]
    assert [r.on_error for r in loaded] == ["raise", "raise", "skip"]
    assert loaded[1].source == "entry point rewards.builtin:format" and loaded[1].args == {"tags": ["think", "answer"]}
    assert loaded[1].fn(["q"], ["<think>a</think><answer>1</answer>"]) == [1.0]


def test_module_function(tmp_path, monkeypatch):
    (tmp_path / "team_rewards.py").write_text("def polite(prompts, completions, **kw):\n"
                                              "    return [float('please' in c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = load_reward("team_rewards:polite", tmp_path)
    assert (loaded.name, loaded.source) == ("polite", "team_rewards:polite")
    assert loaded.fn(["q"], ["please", "no"]) == [1.0, 0.0]
    assert load_reward("rewards.builtin:exact_match", tmp_path).fn is load_reward("exact_match", tmp_path).fn


def test_file_function_relative_to_the_recipe_file(tmp_path, monkeypatch):
    recipe_dir = tmp_path / "project" / "recipes"
    (recipe_dir / "lib").mkdir(parents=True)
    (recipe_dir / "lib" / "my_rewards.py").write_text(textwrap.dedent("""\
        from rewards.registry import reward_factory

        def short(prompts, completions, **kwargs):
            return [float(len(c) < 5) for c in completions]

        @reward_factory
        def contains(word):
            def contains_reward(prompts, completions, **kwargs):
                return [float(word in c) for c in completions]
            contains_reward.__name__ = f"contains_{word}"
            return contains_reward
        """))
    recipe = write_recipe(recipe_dir / "r.yaml", [{
        "name": "grpo", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"),
        "rewards": ["lib/my_rewards.py:short", {"name": "lib/my_rewards.py:contains", "args": {"word": "cat"}}]}])
    monkeypatch.chdir(tmp_path)  # not the recipe's directory: paths are relative to the recipe file
    loaded_recipe = load_recipe(str(recipe.relative_to(tmp_path)))
    loaded = load_rewards(loaded_recipe.stage("grpo").rewards, loaded_recipe.base_dir)
    assert [r.name for r in loaded] == ["short", "contains_cat"]
    assert loaded[0].source == f"{recipe_dir / 'lib' / 'my_rewards.py'}:short"
    assert loaded[1].fn(["q"], ["a cat", "a dog"]) == [1.0, 0.0]


def test_entry_point_of_an_installed_package(installed, tmp_path):
    assert "shouting" in known_rewards() and "(kit-extra-rewards)" in known_rewards()["shouting"]
    shouting = load_reward("shouting", tmp_path)
    assert shouting.source == "entry point kit_extra_rewards:shouting"
    assert shouting.fn(["q"], ["HELLO", "hello"]) == [1.0, 0.0]
    prefixed = load_reward({"name": "prefixed", "args": {"prefix": "B:"}}, tmp_path)
    assert prefixed.fn(["q"], ["B: yes", "A: no"]) == [1.0, 0.0]


def test_kit_rewards_list_shows_builtins_and_packages(installed, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one row per reward
    output = run_cli("rewards", "list").output
    for name in BUILTINS | {"shouting", "prefixed"}:
        assert name in output
    assert "built-in" in output and "kit-extra-rewards (kit_extra_rewards:shouting)" in output
    assert "1.0 for a completion in capital" in output  # the one-line doc


def test_kit_rewards_list_in_a_fresh_process_sees_the_package(extra_rewards_package):
    env = {"PYTHONPATH": str(extra_rewards_package), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    result = subprocess.run([str(Path(sys.executable).with_name("kit")), "rewards", "list"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "shouting" in result.stdout and "kit-extra-rewards (kit_extra_rewards:shouting)" in result.stdout


def test_two_packages_claiming_one_name_is_an_error(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(rival_distribution(tmp_path, "kit.rewards", "exact_match")))
    with pytest.raises(KitError, match="'exact_match' is registered by more than one package: .*rival"):
        load_reward("exact_match", tmp_path)


@pytest.mark.parametrize("name, first", [("exact_macth", "exact_match"), ("formt", "format"),
                                         ("math_equals", "math_equal"), ("codeexec", "code_exec")])
def test_unknown_name_lists_the_known_ones_closest_first(name, first, tmp_path):
    with pytest.raises(KitError) as error:
        load_reward(name, tmp_path, "r.yaml: rewards[0]")
    message = error.value.format_message()
    assert message.startswith(f"r.yaml: rewards[0]: unknown reward '{name}'. Did you mean '{first}'?")
    listed = message.split("Known rewards: ")[1].split(" (")[0].split(", ")
    assert listed[0] == first and set(listed) >= BUILTINS


@pytest.mark.parametrize("spec, words", [
    ({"name": "format", "args": {"tag": ["a"]}}, "has no argument 'tag'; did you mean 'tags'?"),
    ({"name": "length_penalty"}, "needs args: max_length"),
    ({"name": "exact_match", "args": {"x": 1}}, "takes no args"),
    ({"name": "format", "weigth": 2}, "unknown key 'weigth'; did you mean 'weight'?"),
    ({"name": "format", "weight": "high"}, "weight must be a number"),
    ({"name": "format", "on_error": "ignore"}, "on_error must be one of raise, skip"),
    ({"name": "format", "args": ["think"]}, "args must be a mapping"),
    ({"name": "format", "args": {"tags": "<think>"}}, "not a valid tag name"),
    ({"name": "reward_model", "args": {"stage": "rm"}}, "needs the run directory"),
    ({"name": "reward_model"}, "exactly one of path"),
    ({"name": "reward_model", "args": {"path": "nowhere"}}, "is not a directory"),
    ({"name": "nothere.py:f"}, "reward file 'nothere.py' does not exist"),
    ({"name": "no_such_module_xyz:f"}, "cannot import reward module 'no_such_module_xyz'"),
    ({"name": "rewards.builtin:exact_matc"}, "has no function 'exact_matc'"),
    (42, "each reward is a name or a mapping"),
])
def test_bad_specs_name_the_fix(spec, words, tmp_path):
    with pytest.raises(KitError) as error:
        load_reward(spec, tmp_path, "r.yaml: rewards[0]")
    assert words in error.value.format_message()


def test_a_broken_reward_file_names_the_file(tmp_path):
    (tmp_path / "broken.py").write_text("import not_a_module_xyz\n")
    with pytest.raises(KitError, match="reward file .*broken.py' failed to import: ModuleNotFoundError"):
        load_reward("broken.py:f", tmp_path)


def test_a_module_or_factory_that_fails_in_its_own_code_is_one_line(tmp_path, monkeypatch):
    """A module that raises at import (not an ImportError), a factory that raises something other than TypeError
    or ValueError: one line naming the reward, the module or the factory's signature, and the error."""
    (tmp_path / "raising_rewards_xyz.py").write_text(
        "def make(level: int):\n    raise RuntimeError('no GPU for the judge')\n")
    (tmp_path / "broken_at_import_xyz.py").write_text("raise RuntimeError('set JUDGE_KEY first')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KitError) as error:
        load_reward({"name": "raising_rewards_xyz:make", "args": {"level": 2}}, tmp_path, "r.yaml: rewards[0]")
    assert error.value.format_message() == ("r.yaml: rewards[0]: reward factory 'raising_rewards_xyz:make' "
                                            "(make(level: int)) raised RuntimeError: no GPU for the judge")
    with pytest.raises(KitError) as error:
        load_reward("broken_at_import_xyz:f", tmp_path, "r.yaml: rewards[0]")
    assert error.value.format_message() == ("r.yaml: rewards[0]: reward module 'broken_at_import_xyz' failed to "
                                            "import: RuntimeError: set JUDGE_KEY first")


def test_run_dir_reaches_factories_that_ask_for_it(tmp_path):
    loaded = load_reward({"name": "reward_model", "args": {"stage": "rm"}}, tmp_path, run_dir=tmp_path / "run")
    assert loaded.name == "reward_model_rm"  # loaded lazily: the stage has not run yet
    with pytest.raises(KitError, match="run the reward stage 'rm' first"):
        loaded.fn(["q"], ["a"])


def test_required_columns_are_checked_before_scoring(tmp_path):
    rewards = load_rewards(["exact_match", {"name": "code_exec", "args": {"tests_column": "checks"}}, "format"],
                           tmp_path)
    assert [required_columns(r.fn) for r in rewards] == [["answer"], ["checks"], []]
    check_columns(rewards, ["prompt", "answer", "checks"], "stage 'grpo'")
    with pytest.raises(KitError, match="reward 'code_exec' needs column 'checks'.*columns: {question: checks}"):
        check_columns(rewards, ["prompt", "answer", "question"], "stage 'grpo'")


def test_kit_rewards_test_prints_a_table_and_the_distribution():
    output = run_cli("rewards", "test", "exact_match", "--data", SAMPLES).output
    assert "exact_match" in output and "answer" in output
    assert "exact_match: 8/8 scored, mean 0.5" in output
    assert output.count("####") >= 2  # a histogram row for 0 and for 1


def test_kit_rewards_test_with_factory_args_and_a_constant_warning():
    output = run_cli("rewards", "test", "examples/my_rewards.py:mentions", "--arg", "words=[apples]",
                     "--data", SAMPLES).output
    assert "mentions_apples" in output
    assert "is constant over the 8 samples (always 0)" in " ".join(output.split())


def test_kit_rewards_test_errors(tmp_path):
    assert "needs column 'tests'" in run_cli("rewards", "test", "code_exec", "--data", SAMPLES, expect=2).output
    assert "does not exist" in run_cli("rewards", "test", "format", "--data", tmp_path / "x.jsonl", expect=2).output
    no_completion = tmp_path / "rows.jsonl"
    no_completion.write_text(json.dumps({"prompt": "p", "text": "t"}) + "\n")
    assert "needs a 'completion' column" in run_cli("rewards", "test", "format", "--data", no_completion,
                                                    expect=2).output
    assert "expected KEY=VALUE" in run_cli("rewards", "test", "format", "--arg", "tags", "--data", SAMPLES,
                                           expect=2).output


def test_the_example_file_runs_and_its_rewards_load():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "my_rewards.py")], capture_output=True,
                            text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ends_with_answer [1.0, 0.5, 0.0]" in result.stdout
    loaded = load_rewards(["examples/my_rewards.py:ends_with_answer",
                           {"name": "examples/my_rewards.py:mentions", "args": {"words": ["apples"]}, "weight": 0.5}],
                          ROOT)
    assert [r.name for r in loaded] == ["ends_with_answer", "mentions_apples"]


def test_reward_modules_import_nothing_heavy():
    code = ("import sys, kitcli.commands.cli, kitcli.commands.rewards, rewards.builtin, rewards.registry, "
            "rewards.guard, rewards.sample_scores, rewards.sandbox, kitcli.commands.rewards_preview, "
            "rewards.reward_model, rewards.text\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'math_verify', 'sympy', 'unsloth') "
            "if m in sys.modules]\nassert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr


def test_compatible_with_trl_reward_functions_both_ways(tmp_path):
    """TRL's own rewards load as module:function; ours take the keyword arguments GRPOTrainer passes."""
    from rewards.guard import RewardStats, guard_rewards

    chat_prompts = [[{"role": "user", "content": "Half of one?"}]] * 2
    chat = [[{"role": "assistant", "content": "<think>\n1/2\n</think>\n<answer>0.5</answer>"}],
            [{"role": "assistant", "content": "no idea"}]]
    trainer_kwargs = {"completion_ids": [[1, 2, 3], [4, 5]], "trainer_state": object(),
                      "log_extra": lambda column, values: None, "log_metric": lambda name, value: None}
    loaded = load_rewards(["trl.rewards:think_format_reward", "math_equal", "exact_match", "format",
                           {"name": "overlong_penalty", "args": {"max_length": 3, "cache": 2}}], tmp_path)
    assert required_columns(loaded[0].fn) == []
    guarded = guard_rewards(loaded, RewardStats())
    for prompts, completions in ((chat_prompts, chat), (["Half of one?"] * 2, [c[0]["content"] for c in chat])):
        scores = [fn(prompts=prompts, completions=completions, answer=["1/2", "1/2"], **trainer_kwargs)
                  for fn in guarded[1:]]
        assert scores == [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [-1.0, -0.5]]
    assert guarded[0](prompts=chat_prompts, completions=chat, **trainer_kwargs) == [1.0, 0.0]
    accuracy = load_reward("trl.rewards:accuracy_reward", tmp_path)
    assert required_columns(accuracy.fn) == ["solution"]
