"""`kit run --dry-run`: every stage's resolved configuration (the TRL config values after the kit's defaults), kit
check's cheap part as YAML comments, and row 1 of each stage's data as its model will read it. No model loads."""

from __future__ import annotations

from pathlib import Path

import yaml
from rich.console import Console

from kitcli.models.chat_template import with_template_text
from kitcli.recipe.load import Recipe
from kitcli.recipe.schema import declared
from kitcli.run.preflight import preflight
from kitcli.training.trl_config import CHANGED


def dry_run(recipe: Recipe, console: Console) -> None:
    """Print every stage's resolved configuration (the TRL config values after the kit's defaults)."""
    described = preflight(recipe, Path("runs") / f"{recipe.name}-DRYRUN", console, as_comments=True).described
    header = {"name": recipe.name, "seed": recipe.seed, "model": recipe.model.model_dump(),
              "lora": recipe.lora.model_dump() if recipe.lora is not None else None}
    console.print(yaml.safe_dump(header, sort_keys=False).rstrip(), highlight=False, markup=False, soft_wrap=True)
    for index, (stage, resolved) in enumerate(zip(recipe.stages, described), start=1):
        console.print(f"\n# stage {index}/{len(recipe.stages)}: {stage.name} ({stage.type})",
                      highlight=False, markup=False)
        for note in resolved.get(CHANGED, ()):  # what the kit changed from the recipe, as comments (and in the lock)
            console.print(f"# changed from the recipe: {note}", highlight=False, markup=False, soft_wrap=True)
        shown = {key: value for key, value in resolved.items() if key != CHANGED}
        console.print(yaml.safe_dump(shown, sort_keys=False, default_flow_style=None, width=120).rstrip(),
                      highlight=False, markup=False, soft_wrap=True)  # YAML: no line broken by the terminal's width
        example = formatted_example(recipe, stage)
        if example:  # as YAML comments, so the dry run's output stays YAML
            lines = "\n".join(f"#   {line}" for line in example.splitlines())
            console.print(f"# row 1 as the model sees it:\n{lines}", highlight=False, markup=False, soft_wrap=True)


def formatted_example(recipe: Recipe, stage) -> str | None:
    """The first row of a stage's data as its model will read it: after `chat:` and `system_prompt`, rendered with
    the model's chat template when the tokenizer is on disk (the tiny model, a local directory, a converted GGUF);
    otherwise the conversation itself. None for data the kit cannot read here (a hub dataset offline)."""
    from kitcli.data.rows import apply_system_prompt, read_rows

    spec = declared(stage, "data")
    if spec is None or not Path(spec.path).is_file():
        return None
    row = read_rows(spec.model_copy(update={"limit": 1}), stage.name)[0]
    kind = stage.spec
    if kind.rows.as_trained is not None:  # e.g. KTO unpairs a pair: its first row is (prompt, chosen, true)
        row = kind.rows.as_trained([row])[0]
    generates = kind.rows.shape == "prompts"  # the model sees the prompt only and writes the rest itself
    keys = [k for k in (("prompt",) if generates else ("prompt", "completion", "chosen", "rejected", "messages",
                                                         "text")) if k in row]
    row = apply_system_prompt([{k: row[k] for k in keys}], declared(stage, "system_prompt"), stage.name, spec.path)[0]
    tokenizer = with_template_text(local_tokenizer(recipe.model.name), recipe.model.chat_template)
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return yaml.safe_dump(row, sort_keys=False, allow_unicode=True).rstrip()
    parts = []
    if isinstance(row.get("messages"), list):
        parts.append(tokenizer.apply_chat_template(row["messages"], tokenize=False))
    elif "prompt" in row:
        prompt = row["prompt"]
        text = (tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
                if isinstance(prompt, list) else prompt)
        reply = row.get("completion", row.get("chosen"))
        if reply is not None:
            text += (reply[0].get("content") or "") if isinstance(reply, list) else reply  # a tool call may have none
        parts.append(text)
    else:
        return yaml.safe_dump(row, sort_keys=False, allow_unicode=True).rstrip()
    return "\n".join(parts).rstrip()


def local_tokenizer(name: str):
    """The model's tokenizer if it is on disk without converting or downloading anything, else None."""
    from kitcli.models import gguf

    if name == "tiny":
        from kitcli.models.tiny import ensure_tiny_model

        folder = ensure_tiny_model()
    else:
        source = gguf.source_file(name)
        folder = gguf.converted_dir(gguf.file_sha256(source)) if source is not None else Path(name)
    if not (folder / "tokenizer_config.json").is_file():
        return None
    from kitcli.run.check import tokenizer_in

    return tokenizer_in(str(folder))  # loaded once per process, shared with the pre-run check
