"""Tools in a GRPO or GSPO stage: what the stage's `tools:` and `environment:` give TRL's GRPOTrainer, checked
before any model loads.

    tools: [calculator, {name: search_file, args: {path: notes.txt}}]
    environment: my_env.py:Counter
    train: {max_tool_calling_iterations: 4}

TRL 1.15's GRPOTrainer (and Unsloth's generated one, which passes both through) takes `tools=` (plain functions)
and `environment_factory=` (a class with `reset` whose public methods are tools, one instance per rollout). After
each generation it parses the reply with the tokenizer's `response_template` (transformers' `parse_response`), calls
the tools, appends their results as `tool` turns and generates again, up to `max_tool_calling_iterations` rounds
and `max_completion_length` tokens in all; tool-result tokens are masked out of the loss. It logs
`tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed calls per call). TRL 1.15's
RLOOTrainer takes neither, so rloo stages have no `tools:`.

What the kit sets: `max_tool_calling_iterations` 4 when the stage has tools (TRL's default, None, allows any number
of rounds until the completion length runs out); `train:` still wins. Each tool is wrapped (tools/registry.py
`guard`) so that bad arguments, an exception or a call past its `timeout` reach the model as an error message and
count as a failure, never stopping training.

Refused here, one line before anything loads: a tool or environment that cannot be found or described (see
tools/registry.py), two tools of one name, and a model whose chat template cannot render a tool-calling conversation
(TRL's `supports_tool_calling`), gives TRL no way to parse tool calls out of a reply (no `response_template` and a
template TRL does not know), or does not keep prefixes and has no training variant in TRL. The tiny model's
tokenizer gets its response template (TRL's Qwen3 one) here, in a stage with tools only (kitcli/models/tiny.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kitcli.errors import KitError
from kitcli.models.chat_template import with_template_text
from kitcli.recipe.schema import declared
from kitcli.recipe.tool_spec import ToolsSection  # noqa: F401  (the stages' section, one import)

if TYPE_CHECKING:
    from kitcli.recipe.schema import ModelSpec

DEFAULT_ITERATIONS = 4  # tool-calling rounds per completion
UNLIMITED_ROUNDS = 1_000  # max_tool_calling_iterations None: TRL's loop runs until the completion length is spent

# The functions below take the stage's typed section (`stage`: a ToolsSection, or an eval stage's, with `tools` and
# `environment`), the recipe's folder (`base_dir`, where tool files are found) and `where` (the stage, for messages).


def has_tools(stage) -> bool:
    return bool(declared(stage, "tools") or declared(stage, "environment"))


def stage_tools(stage, base_dir: Path, where: str) -> tuple[list, type | None]:
    """The stage's loaded tools (tools/registry.py LoadedTool, guarded) and its guarded environment class (or None)."""
    from tools.registry import load_environment, load_tools

    tools = load_tools(declared(stage, "tools") or [], base_dir, f"{where}: tools")
    environment = declared(stage, "environment")
    if environment is None:
        return tools, None
    return tools, load_environment(environment, base_dir, f"{where}: environment", tools)


def stage_schemas(stage, base_dir: Path, where: str) -> list[dict[str, Any]]:
    """The JSON schemas of the stage's tools and its environment's tool methods, as TRL gives them to the chat
    template (none without tools)."""
    if not has_tools(stage):
        return []
    from tools.registry import check_tool, environment_methods

    tools, environment = stage_tools(stage, base_dir, where)
    methods = environment_methods(environment) if environment is not None else {}
    return [t.schema for t in tools] + [check_tool(fn, name, where, method=True) for name, fn in methods.items()]


def tool_defaults(stage, where: str) -> dict[str, Any]:
    """The config fields the kit sets for a stage with tools; train.max_tool_calling_iterations without tools is
    refused (it would do nothing)."""
    if has_tools(stage):
        return {"max_tool_calling_iterations": DEFAULT_ITERATIONS}
    if "max_tool_calling_iterations" in stage.train:
        raise KitError(f"{where}: train.max_tool_calling_iterations only matters when the model can call tools; "
                       f"give the stage tools: (e.g. tools: [calculator]) or remove it")
    return {}


def describe_tools(stage, model: ModelSpec, base_dir: Path, where: str) -> dict[str, Any]:
    """Load and check the stage's tools and its model's chat template (`model`: the recipe's, before any model
    loads); what `--dry-run` prints about them."""
    if not has_tools(stage):
        return {}
    tools, environment = stage_tools(stage, base_dir, where)
    check_prompts(stage, where)
    tokenizer = with_template_text(preflight_tokenizer(model.name), model.chat_template)
    if tokenizer is not None:
        check_template(tokenizer, model.name, where)
    described: dict[str, Any] = {"tools": [f"{t.name} ({t.source})" for t in tools]}
    if environment is not None:
        from tools.registry import environment_methods

        described["environment"] = f"{stage.environment} (tools: {', '.join(environment_methods(environment))})"
    return described


def tool_kwargs(stage, tokenizer, model_name: str, base_dir: Path, where: str) -> dict[str, Any]:
    """The GRPOTrainer keyword arguments for the stage's tools (none without them), after checking the loaded
    tokenizer's template (a hub model's tokenizer is first seen here when it was not in the local cache)."""
    if not has_tools(stage):
        return {}
    check_template(tokenizer, model_name, where)
    tools, environment = stage_tools(stage, base_dir, where)
    kwargs: dict[str, Any] = {"tools": [t.fn for t in tools]}
    if environment is not None:
        kwargs["environment_factory"] = environment
    return kwargs


def stage_toolbox(stage, tokenizer, values: Any, *, model_name: str, base_dir: Path, where: str):
    """The stage's tools as difficulty filtering and `kit check --signal` sample with them
    (kitcli/models/tool_loop.py Toolbox; None without tools). `values` is the stage's resolved config (a TRL config
    or a dict): its max_tool_calling_iterations, as the trainer will use it (None: no limit but the length)."""
    if not has_tools(stage):
        return None
    from kitcli.models.tool_loop import Toolbox

    if declared(stage, "environment"):
        raise KitError(f"{where}: filter: samples the starting policy with the stage's tools: but cannot run an "
                       f"environment: (TRL makes one instance per rollout); remove filter: (or the environment)")
    check_template(tokenizer, model_name, where)
    tools, _ = stage_tools(stage, base_dir, where)
    rounds = values.get("max_tool_calling_iterations") if isinstance(values, dict) else \
        getattr(values, "max_tool_calling_iterations", None)
    return Toolbox({t.name: t.fn for t in tools}, [t.schema for t in tools],
                   UNLIMITED_ROUNDS if rounds is None else int(rounds))


def check_prompts(stage, where: str) -> None:
    """Tool schemas reach the model through the chat template, which TRL applies only to conversational prompts."""
    spec = stage.data
    if spec.chat or declared(stage, "system_prompt") or not Path(spec.path).is_file():
        return
    from kitcli.data.rows import read_rows

    rows = read_rows(spec, where)
    if isinstance(rows[0].get("prompt"), str):
        raise KitError(f"{where}: tools: the model sees the tools through its chat template, which TRL applies "
                       f"only to conversational prompts, and '{spec.path}' has plain-text prompts; set data: "
                       f"{{chat: true}} (or a system_prompt:)")


def preflight_tokenizer(name: str):
    """The model's tokenizer without loading the model or downloading anything (None when it is not on disk yet)."""
    from kitcli.models import gguf

    if name == "tiny":
        from kitcli.models.tiny import ensure_tiny_model

        folder = ensure_tiny_model()
    else:
        source = gguf.source_file(name)
        folder = Path(name) if source is None else gguf.converted_dir(gguf.file_sha256(source))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # noqa: BLE001  (not in the local cache, gated, a GGUF not converted yet: checked at load)
        return None


def attach_response_template(tokenizer, model: str) -> None:
    """The tiny model's response template (kitcli/models/tiny.py says why only in a stage with tools)."""
    if model == "tiny" and getattr(tokenizer, "response_template", None) is None:
        from kitcli.models.tiny import RESPONSE_TEMPLATE

        tokenizer.response_template = RESPONSE_TEMPLATE


def check_template(tokenizer, model: str, where: str) -> None:
    """The template can render a tool-calling conversation, TRL can parse tool calls out of a reply, and it keeps
    prefixes (or TRL has a training variant of it): what GRPOTrainer needs with tools. The tiny model's tokenizer
    gets its response template here."""
    import copy

    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    fix = "use a model whose template supports tools (e.g. tiny, Qwen2.5 or Qwen3), or remove tools:"
    attach_response_template(tokenizer, model)
    if not supports_tool_calling(tokenizer):
        raise KitError(f"{where}: tools: the chat template of '{model}' cannot render a tool-calling conversation "
                       f"(an assistant turn with tool_calls and a tool turn); {fix}")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(copy.deepcopy(tokenizer))
        except ValueError:
            raise KitError(f"{where}: tools: TRL cannot parse tool calls out of '{model}''s replies: its tokenizer has "
                           f"no response_template and TRL does not know its chat template; add a response_template "
                           f"to its tokenizer_config.json, or {fix}") from None
    if not is_chat_template_prefix_preserving(tokenizer):
        try:
            get_training_chat_template(tokenizer)
        except ValueError:
            raise KitError(f"{where}: tools: the chat template of '{model}' renders earlier turns differently once "
                           f"later ones follow, and TRL has no training variant of it; {fix}") from None


def evaluate_with_tools(stage, model, tokenizer, rows: list[dict[str, Any]], records: list[dict[str, Any]],
                        settings: dict[str, Any], *, model_name: str, base_dir: Path, where: str) -> dict[str, Any]:
    """An eval stage's run with its tools (`stage`: its typed section): the same multi-turn loop as GRPO's, greedy,
    one conversation per row (the first of each row's records gets it). Returns the summary's tool figures and a
    headline part."""
    from kitcli.models.generate import exact_match
    from kitcli.models.tool_loop import generate_with_tools

    check_template(tokenizer, model_name, where)
    tools, _ = stage_tools(stage, base_dir, where)
    iterations = stage.max_tool_calling_iterations
    conversations = generate_with_tools(model, tokenizer, [row["prompt"] for row in rows],
                                        {t.name: t.fn for t in tools}, [t.schema for t in tools],
                                        max_new_tokens=settings["max_new_tokens"], max_iterations=iterations,
                                        batch_size=settings["batch_size"])
    calls = sum(c.calls for c in conversations)
    failures = sum(c.failures for c in conversations)
    summary: dict[str, Any] = {"tool_calls_per_problem": calls / len(rows), "tool_calls": calls,
                               "tool_failures": failures, "tool_failure_rate": failures / calls if calls else 0.0,
                               "max_tool_calling_iterations": iterations}
    n = len(records) // len(rows)
    for row, conversation, record in zip(rows, conversations, records[::n]):
        record["with_tools"] = {"turns": conversation.turns, "calls": conversation.calls,
                                "failures": conversation.failures, "final_answer": conversation.final_answer}
        if "answer" in row:
            record["with_tools"]["correct"] = exact_match(conversation.final_answer, row["answer"])
    figures = f"{calls / len(rows):.2f} tool calls per problem, {failures} failed"
    if "answer" in rows[0]:
        correct = sum(r["with_tools"]["correct"] for r in records[::n])
        summary.update({"exact_match_with_tools": correct / len(rows), "correct_with_tools": correct})
        figures = f"exact match {correct / len(rows):.3f} ({correct}/{len(rows)}), {figures}"
    summary["headline_tools"] = f"with tools: {figures}"
    return summary
