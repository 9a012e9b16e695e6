"""Unsloth's generated GRPO trainer (GRPO and GSPO stages on a GPU; on a CPU with KIT_TRAINERS=unsloth) against TRL's
GRPOTrainer, where the two differ in what a user reads or in what is trained, and what the kit does about each.
Read from unsloth_zoo/rl_replacements.py, unsloth/models/rl_replacements.py and unsloth/utils/prefix_grouper.py
(Unsloth 2026.10.9; docs/stages.md).

- The `kl` metric. Unsloth logs the mean of per-sequence means (`grpo_compute_loss`, its `masked_batch_mean`), TRL the
  mean over every completion token (`global_masked_mean`): they differ whenever completions differ in length. The kit
  rewrites that one aggregation in the generated module (`token_weighted_kl`), so `kl` (dashboard, alarms, report,
  DONE) is TRL's token-weighted mean on both families; the loss is not touched. With beta 0 Unsloth still logs a `kl`
  of 0, which TRL does not log: the kit drops it.
- The loss mask. Unsloth rebuilds the completion mask as "token != pad id" and moves every pad-id token of a row to
  its end before scoring (`create_completion_attention_mask`, `left_pack_padding`); TRL's mask runs up to and
  including the first stop token. With a pad token that is a stop token (pad = EOS: SmolLM2, or any tokenizer the
  CPU loaders give pad = eos), Unsloth never trains the EOS that ends a completion, and drops the EOS tokens of a chat
  prompt, scoring completions after another prompt. `repair_pad_token` gives such a tokenizer a reserved pad-like
  token no text uses (from Unsloth's own list, as its GPU loader does for pad = eos) before the trainer reads it;
  where there is none the stage stops (exit 2), before loading when the tokenizer is on disk (`check_pad_token`).
- Speed paths. Unsloth scores completions on packed rows (sequence packing) and computes each prompt once for its
  group (shared-prefix attention, its PrefixGrouper), each accepted by a self-check against the plain forward at up
  to 0.7 nats per token. A stage's `unsloth:` keys (kitcli/recipe/unsloth_spec.py) turn each off, for this trainer's
  calls only (`speed_paths`). Unsloth prints its check's difference only with UNSLOTH_ENABLE_LOGGING: the kit turns
  that on inside the two scoring calls, keeps the lines, and records per path whether it ran and the largest
  difference (`SpeedRecord`) in DONE and the report.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kitcli.errors import KitError

if TYPE_CHECKING:
    from kitcli.recipe.schema import ModelSpec
    from kitcli.recipe.unsloth_spec import UnslothSpec

# recipe key -> the environment variable Unsloth reads for it
SPEED_PATHS = {"sequence_packing": "UNSLOTH_GRPO_SEQ_PACKING", "shared_prefix_attention": "UNSLOTH_GRPO_PREFIX_GROUPER"}
LABELS = {"sequence_packing": "sequence packing", "shared_prefix_attention": "shared-prefix attention (PrefixGrouper)"}
VERIFY_TOLERANCE = 0.7  # nats per token: both of Unsloth's self-checks accept a largest difference below this
UNSLOTH_LINE = "[Unsloth] GRPO"  # how Unsloth's scoring code starts every line it prints under UNSLOTH_ENABLE_LOGGING
TOKEN_WEIGHTED_KL = "token-weighted mean over completion tokens (TRL's definition)"
OFF_VALUES = ("0", "false", "no", "off")


# --- the kl metric ------------------------------------------------------------------------------------------------

SEQUENCE_MEAN = re.compile(r"\n(?P<indent>[ \t]+)mean_kl_per_reward = .*?\n(?P=indent)return completion_length, "
                           r"mean_kl\n", re.S)


def token_weighted_kl(module, where: str) -> None:
    """Make the generated module's `grpo_compute_loss` (and its compiled twin) return TRL's token-weighted mean of
    the KL term as its metric instead of the mean of per-sequence means. Once per module; the loss is unchanged."""
    if getattr(module, "_kit_token_weighted_kl", False):
        return
    for name in ("grpo_compute_loss", "grpo_compute_loss_slow"):
        function = getattr(module, name, None)
        if function is None and name.endswith("_slow"):
            continue
        source, first = inspect.getsourcelines(function) if function is not None else ([], 0)
        patched, found = SEQUENCE_MEAN.subn(
            lambda m: f"\n{m['indent']}mean_kl = (x * mask).sum() / mask.sum().clamp(min = 1.0)\n"
                      f"{m['indent']}return completion_length, mean_kl\n", "".join(source))
        if found != 1:
            raise KitError(f"{where}: this Unsloth's GRPO trainer averages its kl metric in a way the kit does not "
                           f"know ({name} in {getattr(module, '__file__', module)}), so the logged kl would not be "
                           f"TRL's token-weighted mean; install the unsloth version pyproject.toml pins")
        # defined again in the generated module's namespace (its globals, as Unsloth built it), at its file's lines
        exec(compile("\n" * (first - 1) + patched, module.__file__, "exec"), vars(module))
    module._kit_token_weighted_kl = True


def placeholder_kl_callback():
    """Drops the `kl` Unsloth logs with beta 0 (always 0; TRL logs none) before the kit's callbacks read the row."""
    from transformers import TrainerCallback

    class DropPlaceholderKL(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            for key in ("kl", "eval_kl"):
                (logs or {}).pop(key, None)

    return DropPlaceholderKL()


# --- the pad token ------------------------------------------------------------------------------------------------

def stop_ids(tokenizer, generation_eos: Any) -> set[int]:
    """The ids TRL's GRPOTrainer ends a completion at (its eos_token_ids): the tokenizer's EOS and the generation
    config's."""
    ids = {tokenizer.eos_token_id, *(generation_eos if isinstance(generation_eos, (list, tuple)) else
                                     [generation_eos])}
    return {int(i) for i in ids if i is not None}


def pad_candidate(tokenizer, avoid: set[int], rows: int | None) -> tuple[str, int] | None:
    """A token to pad with that is not a stop token, BOS or in the chat template, from Unsloth's list of reserved
    pad-like tokens (exact names, or name prefixes for numbered families such as `<|reserved`), in its order."""
    from unsloth_zoo.pad_token import POSSIBLE_RESERVED_TOKENS

    template = str(getattr(tokenizer, "chat_template", None) or "")
    for vocabulary in (tokenizer.get_added_vocab, tokenizer.get_vocab):  # the whole vocabulary only if need be
        tokens = sorted((token_id, token) for token, token_id in vocabulary().items()
                        if token_id not in avoid and token_id != tokenizer.bos_token_id and
                        (rows is None or token_id < rows) and token not in template)
        for name in POSSIBLE_RESERVED_TOKENS:
            prefix = not name.endswith((">", "]", ")"))
            for token_id, token in tokens:
                if token == name or (prefix and token.startswith(name)):
                    return token, token_id
    return None


def pad_refusal(where: str, tokenizer) -> KitError:
    return KitError(f"{where}: the tokenizer pads with a stop token ({tokenizer.pad_token or tokenizer.eos_token!r}) "
                    f"and has no reserved token to pad with instead; Unsloth's GRPO trainer masks the loss by the pad "
                    f"id, so it would never train the token that ends a completion; use a model whose tokenizer has "
                    f"a pad token that is not a stop token")


def repair_pad_token(loaded, where: str, log=print, label: str = "") -> dict[str, Any] | None:
    """Before Unsloth's GRPO trainer is built around `loaded` (a backend.LoadedModel): a pad token that is a stop
    token is replaced by `pad_candidate`'s. Returns what changed, or None."""
    tokenizer, model = loaded.tokenizer, loaded.model
    stops = stop_ids(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in stops:
        return None
    found = pad_candidate(tokenizer, stops, model.get_input_embeddings().weight.shape[0])
    if found is None:
        raise pad_refusal(where, tokenizer)
    old = (tokenizer.pad_token, tokenizer.pad_token_id)
    tokenizer.pad_token = found[0]
    model.config.pad_token_id = found[1]
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = found[1]
    change = {"from": old[0], "to": found[0],
              "why": "the pad token was a stop token; Unsloth's GRPO trainer masks the loss by the pad id"}
    log(f"{label or where}: pad token {old[0]!r} (id {old[1]}) is a stop token, and Unsloth's GRPO trainer masks "
        f"the loss by the pad id (it would never train the token that ends a completion): padding with "
        f"{found[0]!r} (id {found[1]}) instead")
    return change


def check_pad_token(model: ModelSpec, where: str) -> None:
    """Before anything loads: the refusal `repair_pad_token` would give, from the tokenizer files alone, where they
    are on disk and the loader is not Unsloth's GPU loader (which repairs a pad = EOS itself, adding a token)."""
    import json
    from pathlib import Path

    from kitcli.models.backend import choose_backend, uncached_hub_model

    name = model.name
    if choose_backend(model.backend) == "unsloth-gpu" or uncached_hub_model(name):
        return
    if name == "tiny":
        from kitcli.models.tiny import ensure_tiny_model

        name = str(ensure_tiny_model(seed=0))
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001  (a GGUF file, no tokenizer files: the check at build time decides)
        return
    generation = Path(name) / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    stops = stop_ids(tokenizer, eos)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad in stops and pad_candidate(tokenizer, stops, None) is None:
        raise pad_refusal(where, tokenizer)


def preflight(model: ModelSpec, chosen: UnslothSpec | None, where: str, log=print) -> None:
    """At a GRPO / GSPO stage's describe, before anything loads: with Unsloth's trainer, a pad token it cannot
    repair stops the stage; with TRL's, an `unsloth:` key that turns a path off is named as doing nothing."""
    from kitcli.training.trainer_classes import family

    if family() == "unsloth":
        check_pad_token(model, where)
        return
    note = ignored_settings(chosen)
    if note:
        log(f"{where}: note: {note}")


# --- speed paths: settings, control and record ---------------------------------------------------------------------

def environment_allows(path: str) -> bool:
    value = os.environ.get(SPEED_PATHS[path])
    return value is None or value.lower() not in OFF_VALUES


def turned_on(chosen: UnslothSpec | None, path: str) -> bool:
    """Whether a stage's `unsloth:` section (None: a stage without one) leaves a speed path to Unsloth."""
    return chosen is None or bool(getattr(chosen, path))


def settings_of(chosen: UnslothSpec | None) -> dict[str, str]:
    """Each speed path's setting for a stage's `unsloth:` section: "on" (Unsloth decides), or "off (why)"."""
    out: dict[str, str] = {}
    for path, variable in SPEED_PATHS.items():
        if not turned_on(chosen, path):
            out[path] = "off (recipe)"
        elif not environment_allows(path):
            out[path] = f"off ({variable}={os.environ[variable]} in the environment)"
        elif path == "shared_prefix_attention" and out["sequence_packing"] != "on":
            out[path] = "off (needs sequence packing)"
        else:
            out[path] = "on"
    return out


def ignored_settings(chosen: UnslothSpec | None) -> str | None:
    """The note for a stage whose `unsloth:` keys turn a path off where TRL's GRPOTrainer trains (no speed paths)."""
    off = [path for path in SPEED_PATHS if not turned_on(chosen, path)]
    if not off:
        return None
    return (f"unsloth: {', '.join(f'{path}: false' for path in off)} does nothing here: this stage trains with TRL's "
            f"GRPOTrainer (no GPU, or a transformers backend), which has no {' or '.join(LABELS[p] for p in off)}")


@dataclass
class SpeedRecord:
    """What Unsloth's scoring did with its speed paths in one stage: the lines its self-checks printed."""

    settings: dict[str, str]
    checks: dict[str, list[float]] = field(default_factory=lambda: {path: [] for path in SPEED_PATHS})
    events: dict[str, list[str]] = field(default_factory=lambda: {path: [] for path in SPEED_PATHS})

    def keep(self, line: str) -> None:
        path = "shared_prefix_attention" if "PrefixGrouper" in line else "sequence_packing"
        measured = re.search(r"max\|d\|=([0-9.]+)", line)
        if measured and " verify: " in line:
            self.checks[path].append(float(measured.group(1)))
        elif len(self.events[path]) < 5 and line not in self.events[path]:
            self.events[path].append(line.removeprefix(UNSLOTH_LINE).strip())

    def summary(self, model) -> dict[str, Any]:
        used = {"sequence_packing": any(getattr(model, f"_unsloth_seq_packing_{g}_ok", None) is True
                                        for g in ("grad", "nograd")),
                "shared_prefix_attention": any(bool(getattr(model, f"_unsloth_prefix_grouper_{g}_verified", None))
                                               for g in ("grad", "nograd"))}
        return {path: {"setting": self.settings[path], "used": used[path], "checks": len(self.checks[path]),
                       "max_difference": max(self.checks[path]) if self.checks[path] else None,
                       "tolerance": VERIFY_TOLERANCE, **({"events": self.events[path]} if self.events[path] else {})}
                for path in SPEED_PATHS}


@contextlib.contextmanager
def speed_paths(module, record: SpeedRecord):
    """Inside one of Unsloth's scoring calls: the stage's paths switched off as its settings say, and Unsloth's
    self-check lines printed into `record` (its logging switched on for the call; other lines go out as before)."""
    from unsloth_zoo.temporary_patches import common

    if "print" in vars(module):  # already inside a call (one scoring call inside another)
        yield
        return
    grouper = sys.modules.get("unsloth.utils.prefix_grouper")
    user_logging = common.UNSLOTH_ENABLE_LOGGING
    saved = {name: getattr(module, name, None) for name in ("UNSLOTH_ENABLE_LOGGING", "UNSLOTH_GRPO_SEQ_PACKING_ON")}
    saved_env, saved_grouper = os.environ.get(SPEED_PATHS["sequence_packing"]), getattr(grouper, "_ENABLED", None)

    def unsloth_print(*args, sep=" ", end="\n", file=None, flush=False):
        text = sep.join(map(str, args))
        if text.startswith(UNSLOTH_LINE):
            record.keep(text)
            if not user_logging:
                return
        builtins.print(*args, sep=sep, end=end, file=file, flush=flush)

    module.print = unsloth_print
    module.UNSLOTH_ENABLE_LOGGING = common.UNSLOTH_ENABLE_LOGGING = True
    if record.settings["sequence_packing"] != "on":
        os.environ[SPEED_PATHS["sequence_packing"]] = "0"  # the grad path reads it at every call
        module.UNSLOTH_GRPO_SEQ_PACKING_ON = False  # the no-grad path (old and reference log-probs) reads this
    if record.settings["shared_prefix_attention"] != "on" and grouper is not None:  # None: it could not be imported
        grouper._ENABLED = False  # both paths ask prefix_grouper_enabled() at every call
    try:
        yield
    finally:
        del module.print
        common.UNSLOTH_ENABLE_LOGGING = user_logging
        for name, value in saved.items():
            setattr(module, name, value)
        if saved_env is None:
            os.environ.pop(SPEED_PATHS["sequence_packing"], None)
        else:
            os.environ[SPEED_PATHS["sequence_packing"]] = saved_env
        if grouper is not None:
            grouper._ENABLED = saved_grouper


def wrap_accumulated_loss(module) -> None:
    """The generated module's `grpo_accumulated_loss` (the scoring and loss of every training step; the trainer passes
    itself as `trainer=`) runs inside `speed_paths` for a trainer the kit attached a record to. Once per module."""
    original = module.grpo_accumulated_loss
    if getattr(original, "_kit_speed_paths", False):
        return

    @functools.wraps(original)
    def grpo_accumulated_loss(*args, **kwargs):
        record = getattr(kwargs.get("trainer"), "kit_speed_record", None)
        if record is None:
            return original(*args, **kwargs)
        with speed_paths(module, record):
            return original(*args, **kwargs)

    grpo_accumulated_loss._kit_speed_paths = True
    module.grpo_accumulated_loss = grpo_accumulated_loss


# --- one trainer ----------------------------------------------------------------------------------------------------

def attach(trainer, chosen: UnslothSpec | None, where: str, log=print, label: str = "") -> None:
    """After a GRPO-kind trainer is built: for Unsloth's, the token-weighted `kl`, the stage's speed-path settings
    and their record; for TRL's, the record that it has none."""
    from kitcli.training.trainer_classes import is_unsloth_class

    if not is_unsloth_class(type(trainer)):
        trainer.kit_grpo_record = {"kl_metric": TOKEN_WEIGHTED_KL, "speed_paths": {
            path: {"setting": "not in TRL's GRPOTrainer", "used": False} for path in SPEED_PATHS}}
        return
    module = sys.modules[type(trainer).__module__]
    token_weighted_kl(module, where)
    wrap_accumulated_loss(module)
    record = SpeedRecord(settings_of(chosen))
    trainer.kit_speed_record = record
    scoring = trainer._get_per_token_logps_and_entropies  # old and reference log-probs (no gradient)

    @functools.wraps(scoring)
    def scored(*args, **kwargs):
        with speed_paths(module, record):
            return scoring(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = scored
    if trainer.beta == 0.0:
        trainer.add_callback(placeholder_kl_callback())
    off = [f"{LABELS[path]} {setting}" for path, setting in record.settings.items() if setting != "on"]
    if off:
        log(f"{label or where}: Unsloth's speed paths: {', '.join(off)}")
    trainer.kit_grpo_record = {"kl_metric": TOKEN_WEIGHTED_KL + "; the kit patched Unsloth's mean of per-sequence "
                                                                 "means"}


def grpo_summary(trainer) -> dict[str, Any]:
    """What a GRPO / GSPO stage's DONE says about its trainer's kl metric, pad token and speed paths."""
    out = dict(getattr(trainer, "kit_grpo_record", None) or {})
    if getattr(trainer, "kit_pad_change", None):
        out["pad_token"] = trainer.kit_pad_change
    record = getattr(trainer, "kit_speed_record", None)
    if record is not None:
        out["speed_paths"] = record.summary(trainer.accelerator.unwrap_model(trainer.model))
    return out
