"""`kit chat` (streaming, multi-turn, /reset and /exit, no TTY needed) and `kit generate` (prompts file to JSONL)."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from helpers import run_cli

from kitcli.commands.chat import resolve_policy_stage
from kitcli.commands.cli import main
from kitcli.errors import KitError

QUESTION = "Ada has 3 apples and gets 5 more. How many apples does Ada have?"


def chat(*args, input: str):  # noqa: A002  (CliRunner's own name)
    """`kit chat` with typed input, through CliRunner: no TTY."""
    result = CliRunner().invoke(main, ["chat", *map(str, args)], input=input)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_chat_streams_turns_resets_and_exits_without_a_tty(trained_run):
    result = chat(trained_run, "--max-new-tokens", "4", input=f"3+4=\n{QUESTION}\n/reset\n/exit\n")
    assert "chatting with stage 'sft'" in result.output  # RUN_DIR alone: the last stage that saved a policy
    assert result.output.count("assistant> ") == 2
    assert "(conversation cleared)" in result.output
    assert "Traceback" not in result.output


def test_chat_keeps_the_conversation_through_the_chat_template(trained_run, monkeypatch):
    from kitcli.commands import chat as chat_module

    seen = []
    original = chat_module.chat_prompt

    def recording(tokenizer, messages):
        text = original(tokenizer, messages)
        seen.append(text)
        return text

    monkeypatch.setattr(chat_module, "chat_prompt", recording)
    chat(f"{trained_run}/sft", "--max-new-tokens", "2", "--system", "Answer with a number.",
         input="3+4=\n2+2=\n/reset\n1+1=\n")  # ends without /exit: end of input quits too
    assert len(seen) == 3
    assert seen[0].startswith("<|im_start|>system\nAnswer with a number.<|im_end|>")
    assert seen[0].endswith("<|im_start|>assistant\n")
    assert "3+4=" in seen[1] and "2+2=" in seen[1] and seen[1].count("<|im_start|>assistant") == 2  # multi-turn
    assert "3+4=" not in seen[2] and "1+1=" in seen[2] and "Answer with a number." in seen[2]  # /reset


def test_generate_writes_one_json_line_per_prompt(trained_run, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": QUESTION}, {"prompt": [{"role": "user", "content": "Bo has 2 cups and gets 1 more. How "
                                                                          "many cups does Bo have?"}]}, "3+4="]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_cli("generate", trained_run, "--prompts", prompts, "--max-new-tokens", "4")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == [rows[0]["prompt"], rows[1]["prompt"], "3+4="]
    assert all(line["stage"] == "sft" and isinstance(line["completion"], str) for line in lines)

    out = tmp_path / "out.jsonl"
    text = tmp_path / "prompts.txt"
    text.write_text(f"{QUESTION}\n\n2+2=\n")
    run_cli("generate", f"{trained_run}/sft", "--prompts", text, "--output", out, "--max-new-tokens", "4")
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prompt"] for w in written] == [QUESTION, "2+2="]
    # greedy: the same prompt gives the same completion in both files
    assert written[0]["completion"] == lines[0]["completion"]


def greedy_replies(model: dict, prompts: list[str], init_from=None) -> list[str]:
    """Greedy replies of the tiny base model, with `init_from`'s adapter or without, loaded and run here."""
    from kitcli.models.backend import load_policy
    from kitcli.models.generate import generate

    loaded = load_policy("tiny", max_seq_length=model["max_seq_length"], load_in_4bit=model["load_in_4bit"],
                         lora=None, dtype=model.get("dtype", "auto"), init_from=init_from, trainable=False,
                         log=lambda _: None)
    replies = generate(loaded.model, loaded.tokenizer, [[{"role": "user", "content": p}] for p in prompts],
                       max_new_tokens=4, temperature=0.0)
    return [reply.strip() for reply in replies]


def test_chat_and_generate_answer_with_the_stage_adapter_not_the_base(trained_run, tmp_path):
    """What `kit generate` and `kit chat` say is what the base model with the stage's adapter says, which here is
    not what the base model alone says (so a command that skipped the adapter would fail)."""
    prompts = ["3+4=", QUESTION, "2+2="]
    model = yaml.safe_load((trained_run / "recipe.lock.yaml").read_text())["recipe"]["model"]
    with_adapter = greedy_replies(model, prompts, init_from=trained_run / "sft")
    assert with_adapter != greedy_replies(model, prompts), "the adapter must change the replies, or this tests nothing"

    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    result = run_cli("generate", f"{trained_run}/sft", "--prompts", tmp_path / "p.txt", "--max-new-tokens", "4")
    assert [json.loads(line)["completion"] for line in result.stdout.splitlines()] == with_adapter
    chatted = [chat(f"{trained_run}/sft", "--max-new-tokens", "4", input=f"{p}\n").stdout for p in prompts]
    assert [text.split("assistant> ", 1)[1].split("you>", 1)[0].strip() for text in chatted] == with_adapter


def fake_run(root, stages, finished=()):
    """A run directory with a lock file and stage folders (no model): for the error paths."""
    root.mkdir(parents=True)
    lock = {"recipe": {"name": "x", "model": {"name": "tiny", "max_seq_length": 64, "load_in_4bit": True},
                       "stages": stages}, "source": "x.yaml"}
    (root / "recipe.lock.yaml").write_text(yaml.safe_dump(lock))
    for name in finished:
        (root / name / "adapter").mkdir(parents=True)
        (root / name / "DONE").write_text("{}")
    return root


def test_chat_and_generate_on_a_run_without_a_finished_policy(tmp_path):
    run = fake_run(tmp_path / "run", [{"name": "sft", "type": "sft"}, {"name": "rm", "type": "reward"}],
                   finished=["rm"])
    (run / "sft").mkdir()
    for command in (["chat", run], ["generate", run, "--prompts", tmp_path / "none.jsonl"]):
        result = run_cli(*command, expect=2)
        assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1
    assert "no finished stage that saved a policy" in run_cli("chat", run, expect=2).output
    assert "has not finished" in run_cli("chat", run / "sft", expect=2).output
    assert "is a reward model" in run_cli("chat", run / "rm", expect=2).output
    assert "did you mean 'sft'" in run_cli("chat", run / "stf", expect=2).output
    assert "is not a run directory" in run_cli("chat", tmp_path, expect=2).output


def test_resolve_picks_the_last_finished_policy_stage(tmp_path):
    run = fake_run(tmp_path / "run", [{"name": "sft", "type": "sft"}, {"name": "dpo", "type": "dpo", "init": "sft"},
                                      {"name": "rm", "type": "reward"}, {"name": "ev", "type": "eval"}],
                   finished=["sft", "dpo", "rm"])
    assert resolve_policy_stage(run, "chat").name == "dpo"
    with pytest.raises(KitError, match="is an eval stage"):
        resolve_policy_stage(run / "ev", "chat")


def test_generate_rejects_a_bad_prompts_file(trained_run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt"}\n')
    result = run_cli("generate", trained_run, "--prompts", bad, expect=2)
    assert "line 2: no 'prompt'" in result.output
