"""What a user sees of tools (issue 28, item 6): tool calls per completion, failures and a sample conversation in the
dashboard and the run report; `kit chat --tools`; `kit plan` for a stage with tools."""

from __future__ import annotations

import io
import json
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import fails, run_cli
from rich.console import Console

from kitcli.display.dashboard import StageDashboard
from kitcli.recipe import stage_types
from kitcli.training.progress import samples_from_trainer

CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*13"}}}]}
FAILED = {"role": "assistant", "content": "Let me try.", "tool_calls": [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1/0"}}}]}
COMPLETIONS = [
    [{"role": "assistant", "content": "156"}],  # no tool
    [CALL, {"role": "tool", "name": "calculator", "content": "156"}, {"role": "assistant", "content": "156"}],
    [FAILED, {"role": "tool", "name": "calculator", "content": "{'error': 'calculator: division by zero'}"},
     CALL, {"role": "tool", "name": "calculator", "content": "156"}, {"role": "assistant", "content": "156"}],
]


def grpo_trainer_logs() -> SimpleNamespace:
    """What TRL's GRPOTrainer keeps for logging (`_logs`) after a step with tools: multi-turn completions."""
    import torch

    logs = {"prompt": deque([[{"role": "user", "content": "What is 12*13?"}]] * 3),
            "completion": deque(COMPLETIONS), "rewards": defaultdict(deque, {"exact_match": deque([1.0, 1.0, 0.0])})}
    return SimpleNamespace(_logs=logs, reward_weights=torch.tensor([1.0]))


def test_samples_keep_the_tool_turns_and_count_calls():
    samples = samples_from_trainer(grpo_trainer_logs())
    assert "turns" not in samples[0] and samples[0]["completion"] == "156"  # as before without tools
    assert samples[1]["turns"] == [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator",
                                                             "arguments": {"expression": "12*13"}}]},
        {"role": "tool", "content": "156", "name": "calculator"}, {"role": "assistant", "content": "156"}]
    assert (samples[1]["tool_calls"], samples[1]["tool_failures"]) == (1, 0)
    assert (samples[2]["tool_calls"], samples[2]["tool_failures"]) == (2, 1)


def grpo_run(tmp_path, samples) -> SimpleNamespace:
    """A run directory with one GRPO stage whose dashboard logged three steps with tool metrics and samples."""
    run = tmp_path / "run"
    (run / "grpo").mkdir(parents=True)
    (run / "recipe.lock.yaml").write_text(yaml.safe_dump({"recipe": {"name": "t", "stages": [
        {"name": "grpo", "type": "grpo", "tools": ["calculator"]}]}}))
    console = Console(file=io.StringIO(), force_terminal=True, width=200, record=True)
    board = StageDashboard("grpo", run / "grpo" / "metrics.jsonl", console, spec=stage_types.spec("grpo"), index=1,
                           total=1)
    board.begin(3)
    for step in (1, 2, 3):
        board.advance(step)
        board.log(step, {"reward": 0.5, "kl": 0.01, "tools/call_frequency": 0.5 * step,
                         "tools/failure_frequency": 0.4 / step}, samples=samples)
    board.end(3)
    return SimpleNamespace(dir=run, screen=console.export_text())


def test_dashboard_and_report_show_tool_calls_failures_and_a_conversation(tmp_path):
    from kitcli.display.report import write_report

    run = grpo_run(tmp_path, samples_from_trainer(grpo_trainer_logs()))
    final = run.screen[run.screen.rindex("3/3"):]  # the last frame of the live panel
    assert "tool_calls 1.5" in final and "tool_failures 0.1333" in final
    assert 'call calculator(expression="1/0"); -> {\'error\': \'calculator: division by zero\'}' in final
    saved = [json.loads(line) for line in (run.dir / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert saved[-1]["turns"][1] == {"role": "tool", "content": "{'error': 'calculator: division by zero'}",
                                     "name": "calculator"}
    report = write_report(run.dir).read_text()
    assert "| tools/call_frequency | 0.5 | 1.5 |" in report and "tools/failure_frequency" in report
    assert "tool calls" in (run.dir / "plots" / "grpo.svg").read_text()  # the panel
    assert '| 1.000 | What is 12*13? | call calculator(expression="12*13"); -> 156; 156 |' in report
    conversation = report[report.index("Sample conversation at step 3 (2 tool calls, 1 failed, reward 0.000):"):]
    assert conversation.splitlines()[2:9] == [
        "- **prompt**: What is 12*13?",
        "- **assistant**: Let me try.",
        '- **call**: `calculator(expression="1/0")`',
        "- **tool calculator (failed)**: {'error': 'calculator: division by zero'}",
        '- **call**: `calculator(expression="12*13")`',
        "- **tool calculator**: 156",
        "- **assistant**: 156"]


def test_a_stage_without_tools_shows_no_tool_lines(tmp_path):
    from kitcli.display.report import write_report

    plain = [{"prompt": "q", "completion": "156", "reward": 1.0, "rewards": {"exact_match": 1.0}}]
    run = grpo_run(tmp_path, plain)
    report = write_report(run.dir).read_text()
    assert "Sample conversation" not in report and "call " not in run.screen


def test_an_eval_stage_with_tools_shows_a_conversation_in_the_report(tmp_path):
    from kitcli.display.report import write_report

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "recipe.lock.yaml").write_text(yaml.safe_dump({"recipe": {"name": "t", "stages": [
        {"name": "eval", "type": "eval", "tools": ["calculator"]}]}}))
    turns = [{"role": "assistant", "content": "", "tool_calls": [{"name": "calculator",
                                                                  "arguments": {"expression": "12*13"}}]},
             {"role": "tool", "name": "calculator", "content": "156"}, {"role": "assistant", "content": "156"}]
    sample = {"prompt": [{"role": "user", "content": "What is 12*13?"}], "completion": "15", "answer": "156",
              "correct": False, "with_tools": {"turns": turns, "calls": 1, "failures": 0, "final_answer": "156",
                                               "correct": True}}
    (run / "eval" / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    (run / "eval" / "DONE").write_text(json.dumps({"exact_match": 0.0, "exact_match_with_tools": 1.0,
                                                   "headline": "exact match 0.000; with tools: exact match 1.000"}))
    report = write_report(run).read_text()
    assert "Sample conversation (1 tool call, 0 failed):" in report
    assert '- **call**: `calculator(expression="12*13")`\n- **tool calculator**: 156\n- **assistant**: 156' in report


# --- kit chat --tools -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, fragment", [
    (["--tools", "calculater"], "--tools[0]: unknown tool 'calculater'. Did you mean 'calculator'?"),
    (["--tools", "calculator,calculator"], "--tools: two tools are named 'calculator'"),
    (["--tools", "calculator", "--temperature", "0.7"], "--temperature: with --tools the replies are greedy"),
])
def test_kit_chat_refuses_bad_tools_before_anything_loads(tmp_path, args, fragment):
    line = fails("chat", tmp_path / "no-such-run", *args)  # the tools are checked first: the run is never read
    assert fragment in line, line


# --- kit plan ---------------------------------------------------------------------------------------------------

def test_kit_plan_counts_the_multi_turn_sequences(tmp_path, tiny_model_dir):
    from helpers import write_recipe
    from tool_helpers import PROMPTS

    grpo = {"name": "grpo", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"], "tools": ["calculator"],
            "train": {"max_completion_length": 256, "max_tool_calling_iterations": 3}}
    evaluation = {"name": "eval", "type": "eval", "data": PROMPTS, "tools": ["calculator"],
                  "generation": {"max_new_tokens": 64}}
    plain = [{**grpo, "name": "grpo-plain", "tools": [], "train": {"max_completion_length": 256}},
             {**evaluation, "name": "eval-plain", "tools": []}]
    recipe = write_recipe(tmp_path / "r.yaml", [grpo, evaluation, *plain],
                          model={"name": "tiny", "max_seq_length": 512})
    stages = json.loads(run_cli("plan", recipe, "--gpu-memory", "8GB", "--json").output)["stages"]
    plan = {s["stage"]: s for s in stages}
    # GRPO: TRL caps the whole completion, tool results included, at max_completion_length: the same sequence
    assert plan["grpo"]["settings"]["seq_len"] == plan["grpo-plain"]["settings"]["seq_len"] == 512
    assert plan["grpo"]["peak_gib"] == plan["grpo-plain"]["peak_gib"] and plan["grpo"]["settings"]["tool_rounds"] == 3
    assert "TRL caps a completion, tool results included, at max_completion_length (256 tokens)" in \
        plan["grpo"]["tools"]
    # eval: each of up to 4 rounds generates up to 64 tokens on the conversation so far: 5 x 64
    assert plan["eval"]["settings"]["completion_len"] == 320 and plan["eval-plain"]["settings"]["completion_len"] == 64
    kv = {name: next(c["gib"] for c in plan[name]["components"] if c["name"].startswith("KV cache"))
          for name in ("eval", "eval-plain")}
    assert kv["eval"] > kv["eval-plain"]
    assert "tools" not in plan["grpo-plain"] and "tools" not in plan["eval-plain"]
    shown = run_cli("plan", recipe, "--gpu-memory", "8GB").output
    assert "  tools: up to 3 rounds of calls per completion; TRL caps" in shown
    assert "planned as 320 generated tokens after the prompt" in shown


def test_kit_chat_refuses_a_template_without_tools_before_the_model_loads(tmp_path, tiny_model_dir):
    """A finished SFT stage of a model whose chat template cannot render tool calls (the stage directory holds no
    weights: the refusal comes from the tokenizer alone, before any load)."""
    import shutil

    from kitcli.models.tiny import PLAIN_CHAT_TEMPLATE

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(PLAIN_CHAT_TEMPLATE)
    run = tmp_path / "run"
    (run / "sft" / "adapter").mkdir(parents=True)
    (run / "sft" / "DONE").write_text("{}")
    (run / "recipe.lock.yaml").write_text(yaml.safe_dump({"recipe": {"name": "t", "model": {
        "name": str(model), "max_seq_length": 512, "load_in_4bit": True}, "stages": [{"name": "sft", "type": "sft"}]}}))
    line = fails("chat", run, "--tools", "calculator")
    assert "--tools (stage 'sft'): tools: the chat template of" in line and "cannot render a tool-calling" in line, line


def test_the_before_after_table_shows_exact_match_with_tools_and_calls():
    """An eval stage with tools reports exact match with and without them; the run's before/after table (and
    bench/seeds.py, which reads the same keys) must show both, the calls per problem and the share of calls that
    failed, not only the run without."""
    from kitcli.display.report import before_after

    sft = ({"name": "eval-sft", "init": "sft"}, {"n": 100, "exact_match": 0.0, "exact_match_with_tools": 0.78,
                                                 "tool_calls_per_problem": 1.0, "tool_failures": 8,
                                                 "tool_failure_rate": 0.08})
    grpo = ({"name": "eval-grpo", "init": "grpo"}, {"n": 100, "exact_match": 0.0, "exact_match_with_tools": 0.81,
                                                    "tool_calls_per_problem": 1.0, "tool_failures": 1,
                                                    "tool_failure_rate": 0.01})
    header, rows = before_after([sft, grpo])
    assert header == ["score", "eval-sft (sft)", "eval-grpo (grpo)", "change"]
    assert rows[:4] == [["exact match", "0.000", "0.000", "+0.000"],
                        ["exact match, with tools", "0.780", "0.810", "+0.030"],
                        ["tool calls per problem", "1.000", "1.000", "+0.000"],
                        ["failed tool calls (share)", "0.080", "0.010", "-0.070"]], rows


def test_seeds_bench_calls_fewer_failed_tool_calls_an_improvement():
    """bench/seeds.py calls a change clear when every seed improved by more than the seed spread: for the share of
    failed tool calls, improved is down (a rise, however steady, is not an improvement)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("seeds_bench", Path(__file__).resolve().parent.parent
                                                  / "bench" / "seeds.py")
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)
    stages = [{"name": "eval-sft", "type": "eval"}, {"name": "grpo", "type": "grpo"}, {"name": "eval-grpo",
                                                                                     "type": "eval"}]

    def run(before: float, after: float) -> tuple[list[dict], list[dict]]:
        return ([{"name": "eval-sft", "init": "sft", "summary": {"exact_match_with_tools": 0.6,
                                                                 "tool_failure_rate": before}},
                 {"name": "eval-grpo", "init": "grpo", "summary": {"exact_match_with_tools": 0.9,
                                                                   "tool_failure_rate": after}}], stages)

    fell = seeds.summarize("t", {1: run(0.10, 0.00), 2: run(0.12, 0.01), 3: run(0.08, 0.00)})
    rose = seeds.summarize("t", {1: run(0.00, 0.10), 2: run(0.01, 0.12), 3: run(0.00, 0.08)})
    assert fell["changes"][0]["scores"]["tool_failure_rate"]["clear"] is True
    assert rose["changes"][0]["scores"]["tool_failure_rate"]["clear"] is False
    assert rose["changes"][0]["scores"]["exact_match_with_tools"]["clear"] is True  # up is better for a score


def test_seeds_bench_takes_a_reward_with_no_score():
    """TRL's contract lets a reward score nothing (None): an eval whose reward scored no sample in one seed leaves
    that reward out of the seeds' table (a mean over seeds needs every seed's figure) and keeps the others."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("seeds_bench", Path(__file__).resolve().parent.parent
                                                  / "bench" / "seeds.py")
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)
    stages = [{"name": "before", "type": "eval"}, {"name": "grpo", "type": "grpo"}, {"name": "after", "type": "eval"}]

    def run(accuracy: float | None) -> tuple[list[dict], list[dict]]:
        return ([{"name": "before", "init": None, "summary": {"exact_match": 0.2, "rewards/accuracy": accuracy}},
                 {"name": "after", "init": "grpo", "summary": {"exact_match": 0.5, "rewards/accuracy": accuracy}}],
                stages)

    result = seeds.summarize("t", {1: run(0.5), 2: run(None), 3: run(0.25)})
    assert list(result["evals"]["before"]) == ["exact_match"]
    assert result["changes"][0]["scores"]["exact_match"]["clear"] is True
    seeds.show(result)
