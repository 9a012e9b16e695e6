"""The run directory: the one module that knows its layout. Everything else asks a RunDir or a StageDir.

    runs/<name>-<timestamp>/
      recipe.lock.yaml        the resolved recipe, package versions, seed, dataset fingerprints
      report.md, plots/       the run report (kitcli/display/report.py)
      libraries.log           what torch, Unsloth, TRL ... printed (kept off the screen: kitcli/libraries.py)
      .writer.lock            held (flock) by the one `kit run` writing here: its pid, host, start time, command
      <stage>/
        config.json           the stage's effective trainer config
        metrics.jsonl         one JSON object per logging step; alarms.jsonl, completions.jsonl beside it
        samples.jsonl         an eval stage's scored completions
        checkpoints/          trainer checkpoints (checkpoint-N/)
        filter/               an RL stage's filter: pass rates (<key>.jsonl) and summary.json
        adapter/ or model/    the trained LoRA adapter (PEFT format) or full model, with the tokenizer
        merged/               a reward stage's adapter merged into a plain sequence-classification model
        critic/               a PPO stage's critic adapter and value head
        DONE                  the completion marker: the stage's summary (JSON)

Files are written under a temporary name and renamed into place, so a kill never leaves half a file behind.
One process writes a run directory at a time: `kit run` holds an OS lock on `.writer.lock` (WriterLock, in
kitcli/writer_lock.py), which the OS releases when the process ends, however it ends; the commands that only read a
run (read_run_lock) say when a run still holds it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kitcli.errors import KitError
from kitcli.records import read_jsonl
from kitcli.writer_lock import (  # noqa: F401  (WriterLock, in_use: kitcli.rundir's names too)
    WriterLock,
    describe_holder,
    in_use,
    lock_holder,
)

LOCK_NAME = "recipe.lock.yaml"
WRITER_LOCK_NAME = ".writer.lock"
# Credentials, by key name: only these are kept out of lock files, configs and reports. A tokenizer's special
# tokens (eos_token, pad_token), token counts (max_new_tokens) and token ids are settings, and a lock keeps them.
CREDENTIAL_KEYS = re.compile(r"(^|_)(api_?key|secret|password|passwd|credentials?)$|"
                             r"^(token|hub_token|hf_token|access_token|auth_token|bearer_token|push_to_hub_token|"
                             r"wandb_api_key|github_token|openai_api_key)$")
REDACTED = "<redacted>"


def write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def redact(value: Any) -> Any:
    """A copy of `value` with every mapping entry whose key names a credential (CREDENTIAL_KEYS) replaced by
    "<redacted>": no token reaches a lock file, a config.json or a report."""
    if isinstance(value, dict):
        return {k: REDACTED if is_credential(k) and v is not None else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def is_credential(key: Any) -> bool:
    return bool(CREDENTIAL_KEYS.search(str(key).lower()))


@dataclass(frozen=True)
class StageDir:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    # --- what a stage writes ---
    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def alarms(self) -> Path:
        return self.path / "alarms.jsonl"

    @property
    def completions(self) -> Path:
        return self.path / "completions.jsonl"

    @property
    def samples(self) -> Path:
        return self.path / "samples.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def filter(self) -> Path:
        return self.path / "filter"

    @property
    def adapter(self) -> Path:
        return self.path / "adapter"

    @property
    def model(self) -> Path:
        return self.path / "model"

    @property
    def merged(self) -> Path:
        return self.path / "merged"

    @property
    def critic(self) -> Path:
        return self.path / "critic"

    @property
    def done_marker(self) -> Path:
        return self.path / "DONE"

    # --- reading and writing ---
    def done(self) -> dict[str, Any] | None:
        """The summary of a finished stage; None while it has not finished (or its marker is damaged)."""
        if not self.done_marker.exists():
            return None
        try:
            return json.loads(self.done_marker.read_text())
        except json.JSONDecodeError:
            return None

    def write_done(self, summary: dict[str, Any]) -> None:
        write_atomic(self.done_marker, json.dumps(summary, indent=2, default=str))

    def write_config(self, settings: dict[str, Any]) -> None:
        write_atomic(self.config, json.dumps(redact(settings), indent=2, default=str))

    def read_config(self) -> dict[str, Any] | None:
        if not self.config.exists():
            return None
        try:
            return json.loads(self.config.read_text())
        except json.JSONDecodeError:
            return None

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics)

    def saved_model(self) -> Path | None:
        """adapter/ (LoRA) or model/ (full fine-tuning), whichever the stage saved."""
        for path in (self.adapter, self.model):
            if path.is_dir():
                return path
        return None

    def has_policy(self) -> bool:
        """Finished, with a saved adapter or model to generate with."""
        return self.done_marker.exists() and self.saved_model() is not None


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def lock_path(self) -> Path:
        return self.path / LOCK_NAME

    @property
    def writer_lock(self) -> Path:
        return self.path / WRITER_LOCK_NAME

    @property
    def report(self) -> Path:
        return self.path / "report.md"

    @property
    def plots(self) -> Path:
        return self.path / "plots"

    @property
    def library_log(self) -> Path:
        return self.path / "libraries.log"

    def stage(self, name: str) -> StageDir:
        return StageDir(self.path / name)

    def is_run(self) -> bool:
        return self.lock_path.is_file()

    def read_lock(self) -> dict[str, Any] | None:
        """The lock file, None when there is none; a damaged one is an error that says so."""
        import yaml

        if not self.lock_path.exists():
            return None
        try:
            lock = yaml.safe_load(self.lock_path.read_text())
        except yaml.YAMLError:
            raise KitError(f"{self.lock_path} is not valid YAML; restore it from a copy of the run, or choose "
                           f"another --output") from None
        return lock if isinstance(lock, dict) else {}

    def write_lock(self, lock: dict[str, Any]) -> None:
        import yaml

        write_atomic(self.lock_path, yaml.safe_dump(lock, sort_keys=False))


def find_run(path: Path) -> tuple[RunDir, str | None] | None:
    """`path` as a run directory (RunDir, None) or a stage directory in one (RunDir, stage name); None otherwise."""
    path = Path(path)
    if RunDir(path).is_run():
        return RunDir(path), None
    if RunDir(path.parent).is_run():
        return RunDir(path.parent), path.name
    return None


def read_run_lock(run: RunDir) -> dict[str, Any]:
    """recipe.lock.yaml of a run, for the commands that only read one (`kit report`, `kit eval RUN`, `kit chat`,
    `kit export`): a mapping with its 'recipe', else one line naming the fault. Says (on stderr) when a `kit run`
    still holds the directory, as what these commands read may then still change."""
    if not run.is_run():
        raise KitError(f"{run.path} is not a kit run directory (no {LOCK_NAME}); give the directory `kit run` "
                       f"printed (runs/<name>-<timestamp>)")
    try:
        lock = run.read_lock()
    except OSError as error:
        raise KitError(f"cannot read {run.lock_path} ({error.strerror or error}); is {run.path} a kit run "
                       f"directory?") from None
    if not isinstance(lock, dict) or not isinstance(lock.get("recipe"), dict):
        raise KitError(f"{run.lock_path} has no 'recipe'; it was not written by `kit run`")
    holder = lock_holder(run)
    if holder is not None:
        import click

        click.echo(f"note: the run is still going ({describe_holder(holder)} holds {run.path}); this reads what it "
                   f"has written so far", err=True)
    return lock
