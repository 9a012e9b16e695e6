"""Datasets for stages: local JSONL / JSON / CSV / Parquet files or a hub dataset, with a `columns:` mapping.

Files are read here (not by `datasets`' builders) so that a malformed line is reported with its file and line
number, and so that a dataset's fingerprint is the hash of the file's bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kitcli.data.tool_rows import check_tool_names, is_tool_call_turn, tool_features
from kitcli.errors import KitError
from kitcli.records import read_jsonl


def fingerprint(spec: Any) -> str:
    """What a dataset (a stage's DataSpec, or its dict) holds: its file's sha256, or for a hub dataset its name."""
    spec = spec if isinstance(spec, dict) else spec.model_dump()
    path = Path(spec["path"])
    if not path.is_file():
        return f"hub:{spec['path']}:{spec.get('config')}:{spec.get('split')}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def read_rows(spec: Any, where: str) -> list[dict[str, Any]]:
    """Rows of the dataset `spec` (a stage's DataSpec, or its dict) names, after the `columns:` renames and the
    `limit`."""
    spec = spec if isinstance(spec, dict) else spec.model_dump()
    path = Path(spec["path"])
    if path.is_file():
        rows = read_file(path)
    else:
        rows = read_hub(spec, where)
    if not rows:
        raise KitError(f"{where}: dataset '{spec['path']}' is empty; it needs at least one row")
    columns = spec.get("columns") or {}
    if columns:
        present = set(rows[0])
        for source in columns:
            if source not in present:
                raise KitError(f"{where}: columns maps '{source}', but '{spec['path']}' has no such column "
                               f"(columns: {', '.join(sorted(present))})")
        rows = [{columns.get(k, k): v for k, v in row.items()} for row in rows]
    if spec.get("limit"):
        rows = rows[: spec["limit"]]
    check_value_types(rows, where, spec["path"], columns)
    if spec.get("chat"):
        rows = as_conversations(rows)
    check_conversations(rows, where, spec["path"])
    return rows


# --- conversations ----------------------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant", "tool")
CONVERSATION_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages")


def as_conversations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`chat: true`: plain-string columns in TRL's conversational format, so that an instruct model's chat template
    formats them (a string prompt skips the template): `prompt` becomes a user turn, `completion` / `chosen` /
    `rejected` an assistant turn. Columns that are conversations already are kept; other columns (e.g. `answer`)
    are untouched."""
    out = []
    for row in rows:
        row = dict(row)
        if isinstance(row.get("prompt"), str):
            row["prompt"] = [{"role": "user", "content": row["prompt"]}]
        for key in ("completion", "chosen", "rejected"):
            if isinstance(row.get(key), str):
                row[key] = [{"role": "assistant", "content": row[key]}]
        out.append(row)
    return out


TEXT_COLUMNS = ("prompt", "completion", "chosen", "rejected", "text")


def check_value_types(rows: list[dict[str, Any]], where: str, path: str, renamed: dict[str, str]) -> None:
    """The text columns hold strings (the conversational ones, or lists of messages) and `answer` a string, a number
    or a list of them (accepted answers), row by row, before any model loads (a tokenizer would fail on the first
    other value with a traceback)."""
    source = {kit: column for column, kit in renamed.items()}
    for number, row in enumerate(rows, start=1):
        for key in (*TEXT_COLUMNS, "answer"):
            value = row.get(key, "")
            if isinstance(value, str) or (key in CONVERSATION_COLUMNS and isinstance(value, list)):
                continue
            if key == "answer" and all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                       for a in (value if isinstance(value, list) and value else [value])):
                continue  # a number, or a list of accepted answers
            column = f"column '{key}'" + (f" (the file's '{source[key]}')" if key in source else "")
            found = "null" if value is None else f"{type(value).__name__} {json.dumps(value, default=str)[:40]}"
            wanted = ("a string, a number or a list of them" if key == "answer" else
                      "a string or a list of messages" if key in CONVERSATION_COLUMNS else "a string")
            raise KitError(f"{where}: row {number} of '{path}', {column} holds {found}; it must be {wanted} (quote "
                           f"it in the file)")


def check_conversations(rows: list[dict[str, Any]], where: str, path: str) -> None:
    """Every message of a conversational column is a mapping with a known role and a string content."""
    for number, row in enumerate(rows, start=1):
        for key in CONVERSATION_COLUMNS:
            messages = row.get(key)
            if not isinstance(messages, list):
                continue
            for index, message in enumerate(messages):
                at = f"{where}: row {number} of '{path}', {key}[{index}]"
                if not isinstance(message, dict):
                    raise KitError(f"{at} is {type(message).__name__} {message!r:.60}; a message is a mapping "
                                   f"{{role: ..., content: ...}}")
                role = message.get("role")
                if role not in ROLES:
                    raise KitError(f"{at} has role {role!r}; a message's role is one of {', '.join(ROLES)}")
                if not isinstance(message.get("content"), str) and not is_tool_call_turn(message, at):
                    what = "no content" if "content" not in message else f"content {message['content']!r:.60}"
                    raise KitError(f"{at} has {what}; each message needs a string content")
                is_tool_call_turn(message, at)  # a turn with content and tool calls: the calls' shape
    check_tool_names(rows, where, path)  # TRL's tool-calling format (kitcli/data/tool_rows.py)


def read_file(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(path, strict=True)
    if suffix == ".json":
        return read_json(path)
    if suffix in (".csv", ".parquet"):
        import pandas as pd

        try:
            frame = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
        except Exception as error:  # noqa: BLE001  (pandas raises many types for a bad file)
            raise KitError(f"{path}: cannot read as {suffix[1:].upper()}: {str(error).splitlines()[0]}") from None
        return frame.to_dict(orient="records")
    raise KitError(f"{path}: unsupported dataset format '{suffix}'; use .jsonl, .json, .csv or .parquet")


def read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise KitError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise KitError(f"{path}: expected a JSON list of objects (or {{\"data\": [...]}})")
    return data


def read_hub(spec: dict[str, Any], where: str) -> list[dict[str, Any]]:
    import datasets
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    if spec["path"] in _PACKAGED_DATASETS_MODULES:  # load_dataset("text") reads every file under the working directory
        raise KitError(f"{where}: data '{spec['path']}' is neither a file here nor a hub dataset: it names one of the "
                       f"`datasets` library's file loaders, which would read every file under {Path.cwd()}; give the "
                       f"path of a data file (e.g. data/train.jsonl) or a hub dataset name (e.g. trl-lib/tldr)")
    try:
        dataset = datasets.load_dataset(spec["path"], spec.get("config"), split=spec.get("split") or "train")
    except Exception as error:  # noqa: BLE001  (a library's error for a missing or unreadable dataset)
        raise KitError(f"{where}: cannot load hub dataset '{spec['path']}' ({type(error).__name__}: "
                       f"{str(error).splitlines()[0][:200]}); check the name, or use a local file when "
                       f"offline") from None
    return list(dataset)


def require_columns(rows: list[dict[str, Any]], needed: list[list[str]], where: str, path: str) -> list[str]:
    """Return the first column set in `needed` that the rows have, or fail naming what exists."""
    present = set(rows[0])
    for option in needed:
        if all(column in present for column in option):
            return option
    wanted = " or ".join("+".join(option) for option in needed)
    missing = [c for c in needed[0] if c not in present]
    example = ""
    if missing and present:
        other = sorted(present - set(needed[0]))
        if other:
            example = f"; map yours with e.g. columns: {{{other[0]}: {missing[0]}}}"
    raise KitError(f"{where}: dataset '{path}' needs columns {wanted}; it has {', '.join(sorted(present))}{example}")


def to_dataset(rows: list[dict[str, Any]]):
    import datasets

    return datasets.Dataset.from_list(rows, features=tool_features(rows))


# --- prompts ----------------------------------------------------------------------------------------------------

def with_system_prompt(prompt: Any, system: str | None) -> Any:
    """A prompt as a conversation that opens with `system` (string prompts become a user turn). A conversation that
    opens with a system message of its own has it replaced: the stage's `system_prompt:` wins, so that a recipe says
    what every row's model sees (keeping the row's would drop the stage's without a word)."""
    if system is None:
        return prompt
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if messages and messages[0].get("role") == "system":
        messages = messages[1:]
    return [{"role": "system", "content": system}, *messages]


def as_reply(completion: Any) -> list[dict[str, Any]]:
    return completion if isinstance(completion, list) else [{"role": "assistant", "content": str(completion)}]


def apply_system_prompt(rows: list[dict[str, Any]], system: str | None, where: str, path: str) -> list[dict[str, Any]]:
    """Every row with `system` as its conversation's first message, the same way in every stage: a `prompt` becomes
    [system, user] (and, for SFT and preference rows, the completion or chosen / rejected an assistant turn, since
    TRL needs both sides in one format); `messages` (and implicit-prompt chosen / rejected conversations) get the
    system message first. A row whose conversation opens with its own system message has it replaced by `system`
    (`with_system_prompt`). Plain `text` rows have no turns to put it before."""
    if system is None:
        return rows
    out = []
    for number, row in enumerate(rows, start=1):
        row = dict(row)
        if "prompt" in row:
            row["prompt"] = with_system_prompt(row["prompt"], system)
            for key in ("completion", "chosen", "rejected"):
                if key in row:
                    row[key] = as_reply(row[key])
        elif "messages" in row:
            row["messages"] = with_system_prompt(row["messages"], system)
        elif "chosen" in row and isinstance(row["chosen"], list):
            row["chosen"] = with_system_prompt(row["chosen"], system)
            row["rejected"] = with_system_prompt(row["rejected"], system)
        else:
            raise KitError(f"{where}: row {number} of '{path}' is plain text (no prompt or messages), so "
                           f"system_prompt has no conversation to open; use prompt/completion or messages data, or "
                           f"remove system_prompt")
        out.append(row)
    return out
