"""Talk to a trained stage: `kit chat` (interactive, streaming) and `kit generate` (a prompts file to JSONL).

    kit chat runs/tiny-sft-20261202-101500            # the last finished stage that saved a policy
    kit chat runs/tiny-sft-20261202-101500/sft        # a named stage
    kit chat runs/tiny-tools-20261206-101500 --tools calculator   # the model may call tools (greedy replies)
    kit generate runs/tiny-sft-20261202-101500 --prompts prompts.jsonl > completions.jsonl

Both load the stage through `kitcli.models.backend.load_policy` (the base model of the run's recipe, with the stage's
adapter, or its full fine-tuned `model/`), and format turns with the tokenizer's chat template, as training did.
`RUN_DIR[/STAGE]` is resolved here for `kit export` too (`resolve_policy_stage`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kitcli.errors import KitError, did_you_mean
from kitcli.rundir import LOCK_NAME, StageDir, find_run, read_run_lock


@dataclass
class PolicyStage:
    run_dir: Path
    stage_dir: Path
    stage: dict[str, Any]
    lock: dict[str, Any]

    @property
    def name(self) -> str:
        return self.stage["name"]

    @property
    def recipe(self) -> dict[str, Any]:
        return self.lock["recipe"]

    @property
    def model(self) -> dict[str, Any]:
        return self.recipe["model"]

    @property
    def dir(self) -> StageDir:
        return StageDir(self.stage_dir)

    @property
    def kind(self) -> str:
        """`adapter` (LoRA) or `model` (full fine-tuning)."""
        return "adapter" if self.dir.adapter.is_dir() else "model"

    @property
    def saved(self) -> Path:
        return self.dir.saved_model() or self.dir.model


def resolve_policy_stage(path: str | Path, command: str) -> PolicyStage:
    """`RUN_DIR` (the last finished stage that saved a policy) or `RUN_DIR/STAGE`."""
    from kitcli.recipe.stage_types import is_policy, spec_output  # the recipe schema: not for `kit --help`

    found = find_run(Path(path))
    if found is None:
        raise KitError(f"'{path}' is not a run directory (no {LOCK_NAME} in it or its parent); give the directory "
                       f"`kit run` printed, e.g. `kit {command} runs/<name>-<time>` or `.../<stage>`")
    run, wanted = found
    run_dir = run.path
    lock = read_run_lock(run)
    stages = [s for s in lock["recipe"].get("stages", []) if isinstance(s, dict) and "name" in s]
    if wanted is None:
        finished = [s for s in stages if is_policy(s.get("type")) and run.stage(s["name"]).has_policy()]
        if not finished:
            raise KitError(f"{run_dir} has no finished stage that saved a policy (an adapter/ or model/ with DONE); "
                           f"finish the run first: `kit run {lock.get('source', 'RECIPE')} --output {run_dir}`")
        stage = finished[-1]
    else:
        names = [s["name"] for s in stages]
        if wanted not in names:
            raise KitError(f"{run_dir} has no stage '{wanted}'{did_you_mean(wanted, names)} "
                           f"(stages: {', '.join(names)})")
        stage = stages[names.index(wanted)]
        if not is_policy(stage.get("type")):
            output = spec_output(stage["type"])
            other = ("a reward model (a sequence classifier, no text generation)" if output == "scorer"
                     else f"{'an' if stage['type'][0] in 'aeiou' else 'a'} {stage['type']} stage (it saves no model)")
            raise KitError(f"stage '{wanted}' is {other}; `kit {command}` needs a policy stage "
                           f"({', '.join(s['name'] for s in stages if is_policy(s.get('type')))})")
        if not run.stage(wanted).has_policy():
            raise KitError(f"stage '{wanted}' of {run_dir} has not finished (no DONE with an adapter/ or model/); "
                           f"finish it with `kit run {lock.get('source', 'RECIPE')} --output {run_dir}`")
    return PolicyStage(run_dir=run_dir, stage_dir=run_dir / stage["name"], stage=stage, lock=lock)


def load_stage_model(policy: PolicyStage, log):
    """The stage's policy, ready to generate (through the one loading place, `backend.load_policy`). Libraries'
    prints go to stderr, so stdout carries only the conversation or the JSONL."""
    import contextlib

    from kitcli.models.backend import load_policy

    model = policy.model
    with contextlib.redirect_stdout(sys.stderr):
        return load_policy(model["name"], max_seq_length=model["max_seq_length"], load_in_4bit=model["load_in_4bit"],
                           lora=None, backend=model.get("backend", "auto"), dtype=model.get("dtype", "auto"),
                           seed=policy.recipe.get("seed", 42), init_from=policy.stage_dir,
                           trust_remote_code=model.get("trust_remote_code", False), trainable=False,
                           chat_template=model.get("chat_template"), log=log, label=f"stage {policy.name}")


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "  # a base model's tokenizer


def sampling_kwargs(temperature: float, top_p: float) -> dict[str, Any]:
    if temperature > 0:
        return {"do_sample": True, "temperature": temperature, "top_p": top_p}
    return {"do_sample": False}


def make_streamer(tokenizer):
    """TextStreamer that writes through click (so it works without a TTY and under CliRunner)."""
    from transformers import TextStreamer

    class EchoStreamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            click.echo(text, nl=stream_end)

    return EchoStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def reply(loaded, messages: list[dict[str, str]], *, max_new_tokens: int, temperature: float, top_p: float,
          stream: bool) -> str:
    import torch

    tokenizer, model = loaded.tokenizer, loaded.model
    batch = tokenizer(chat_prompt(tokenizer, messages), return_tensors="pt", add_special_tokens=False).to(model.device)
    model.eval()
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                streamer=make_streamer(tokenizer) if stream else None,
                                **sampling_kwargs(temperature, top_p))
    return tokenizer.decode(output[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def chat_tools(names: tuple[str, ...], temperature: float) -> list:
    """`--tools`, resolved as a stage's `tools:` (built-ins, module:fn, path/to/file.py:fn, entry points; file paths
    from the current directory) and guarded the same way; refused in one line before anything loads."""
    if not names:
        return []
    if temperature > 0:
        raise KitError("--temperature: with --tools the replies are greedy, as in an eval stage with tools (the "
                       "loop kit chat shares with it); drop --temperature or --tools")
    from tools.registry import load_tools

    return load_tools([n.strip() for name in names for n in name.split(",") if n.strip()], Path.cwd(), "--tools")


def check_chat_template(policy: PolicyStage, tokenizer=None) -> None:
    """The stage's chat template renders and parses tool calls (the checks of a stage with tools); before the model
    loads when its tokenizer is on disk, and on the loaded tokenizer (the tiny one gets its response template)."""
    from kitcli.models.chat_template import with_template_text
    from kitcli.training.tool_use import check_template, preflight_tokenizer

    name = policy.model["name"]
    if tokenizer is None:
        tokenizer = with_template_text(preflight_tokenizer(name), policy.model.get("chat_template"))
    if tokenizer is not None:
        check_template(tokenizer, name, f"--tools (stage '{policy.name}')")


def tool_reply(loaded, messages: list[dict[str, Any]], tools: list, *, max_new_tokens: int,
               max_iterations: int) -> list[dict[str, Any]]:
    """One answer with tools, in the eval stage's loop (kitcli/models/tool_loop.py): the turns it added, each shown
    as it reads (calls, tool answers, the final text)."""
    from kitcli.display.conversation import tool_turns, turn_parts
    from kitcli.models.tool_loop import generate_with_tools

    conversation = generate_with_tools(loaded.model, loaded.tokenizer, [messages], {t.name: t.fn for t in tools},
                                       [t.schema for t in tools], max_new_tokens=max_new_tokens,
                                       max_iterations=max_iterations, batch_size=1)[0]
    for turn in tool_turns(conversation.turns) or [{"role": "assistant", "content": conversation.final_answer}]:
        for who, what in turn_parts(turn):
            click.echo(f"{'assistant' if who == 'call' else who}> {'calls ' + what if who == 'call' else what}")
    return conversation.turns


def run_chat(path: str, *, system: str | None, max_new_tokens: int, temperature: float, top_p: float,
             seed: int, tools: tuple[str, ...] = (), max_iterations: int = 4) -> None:
    import torch

    loaded_tools = chat_tools(tools, temperature)
    policy = resolve_policy_stage(path, "chat")
    if loaded_tools:
        check_chat_template(policy)
    loaded = load_stage_model(policy, log=lambda message: click.echo(message, err=True))
    if loaded_tools:
        check_chat_template(policy, loaded.tokenizer)
    torch.manual_seed(seed)
    with_tools = f" with tools {', '.join(t.name for t in loaded_tools)}" if loaded_tools else ""
    click.echo(f"chatting with stage '{policy.name}' of {policy.run_dir} ({policy.kind}){with_tools}; /reset clears "
               f"the conversation, /exit (or Ctrl-D) quits", err=True)
    fresh = [{"role": "system", "content": system}] if system else []
    messages = list(fresh)
    while True:
        try:
            line = click.prompt("you", prompt_suffix="> ", default="", show_default=False)
        except (EOFError, click.exceptions.Abort):
            click.echo("", err=True)
            return
        text = line.strip()
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            messages = list(fresh)
            click.echo("(conversation cleared)", err=True)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        if loaded_tools:
            messages += tool_reply(loaded, messages, loaded_tools, max_new_tokens=max_new_tokens,
                                   max_iterations=max_iterations)
            continue
        click.echo("assistant> ", nl=False)
        answer = reply(loaded, messages, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       stream=True)
        messages.append({"role": "assistant", "content": answer})


# --- kit generate ----------------------------------------------------------------------------------------------

def read_prompts(path: str) -> list[Any]:
    """A JSONL file with a `prompt` column (a string or a list of messages), or a text file with one per line."""
    file = Path(path)
    if not file.is_file():
        raise KitError(f"--prompts '{path}' does not exist; give a JSONL file with a 'prompt' column or a text "
                       f"file with one prompt per line")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise KitError(f"--prompts '{path}' is empty")
    if file.suffix.lower() not in (".jsonl", ".json"):
        return lines
    prompts = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise KitError(f"{path}, line {number}: not valid JSON ({error.msg}); one JSON object per line, "
                           f"e.g. {{\"prompt\": \"2+3=\"}}") from None
        if isinstance(row, str):
            prompts.append(row)
        elif isinstance(row, dict) and row.get("prompt") not in (None, "", []):
            prompts.append(row["prompt"])
        else:
            raise KitError(f"{path}, line {number}: no 'prompt' (a string or a list of messages)")
    return prompts


def as_messages(prompt: Any, system: str | None) -> list[dict[str, str]]:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if system and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def run_generate(path: str, *, prompts_file: str, output: str, system: str | None, max_new_tokens: int,
                 temperature: float, batch_size: int, seed: int) -> None:
    import contextlib

    import torch

    from kitcli.models.generate import generate

    prompts = read_prompts(prompts_file)
    policy = resolve_policy_stage(path, "generate")
    out = None
    if output != "-":
        out = Path(output)
        if out.parent and not out.parent.exists():
            raise KitError(f"--output '{output}': folder {out.parent} does not exist")
    loaded = load_stage_model(policy, log=lambda message: click.echo(message, err=True))
    torch.manual_seed(seed)
    conversations = [as_messages(p, system) for p in prompts]
    with contextlib.redirect_stdout(sys.stderr):
        completions = generate(loaded.model, loaded.tokenizer, conversations, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, temperature=temperature, seed=seed)
    rows = [json.dumps({"prompt": prompt, "completion": completion.strip(), "stage": policy.name},
                       ensure_ascii=False) for prompt, completion in zip(prompts, completions)]
    text = "".join(row + "\n" for row in rows)
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        out.write_text(text, encoding="utf-8")
        click.echo(f"wrote {len(rows)} completions to {out}", err=True)


@click.command("chat")
@click.argument("run_dir", metavar="RUN_DIR[/STAGE]")
@click.option("--system", help="A system message that opens the conversation.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Most tokens per reply.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 for greedy replies.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling (temperature > 0).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampling.")
@click.option("--tools", multiple=True, metavar="NAME",
              help="Tools the model may call, named as in a stage's tools: (calculator, my_tools.py:fn; repeat or "
                   "separate with commas); replies then run the eval stage's greedy tool loop.")
@click.option("--max-tool-calling-iterations", "max_iterations", type=click.IntRange(min=1), default=4,
              show_default=True, help="With --tools: most rounds of tool calls per answer.")
def chat_command(run_dir: str, system: str | None, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int, tools: tuple[str, ...], max_iterations: int) -> None:
    """Chat with a trained stage (streaming, multi-turn; --tools lets it call tools); /reset clears, /exit quits."""
    run_chat(run_dir, system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
             tools=tools, max_iterations=max_iterations)


@click.command("generate")
@click.argument("run_dir", metavar="RUN_DIR[/STAGE]")
@click.option("--prompts", "prompts_file", required=True,
              help="JSONL with a 'prompt' column (a string or messages), or a text file with one prompt per line.")
@click.option("--output", "-o", default="-", show_default=True, help="JSONL file to write ('-': stdout).")
@click.option("--system", help="A system message before each prompt.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Most tokens per completion.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 for greedy completions.")
@click.option("--batch-size", type=int, default=16, show_default=True, help="Prompts generated together.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampling.")
def generate_command(run_dir: str, prompts_file: str, output: str, system: str | None, max_new_tokens: int,
                     temperature: float, batch_size: int, seed: int) -> None:
    """Generate completions for a file of prompts with a trained stage, as JSONL."""
    run_generate(run_dir, prompts_file=prompts_file, output=output, system=system, max_new_tokens=max_new_tokens,
                 temperature=temperature, batch_size=batch_size, seed=seed)
