"""`kit import FILE`: a TRL CLI / open-r1 YAML or an axolotl YAML as a kit recipe, read through the table of names
from other tools (kitcli/recipe/foreign_table.py, docs/foreign-names.md).

    kit import config_demo.yaml -o qwen-grpo.yaml        # open-r1's GRPO demo (TRL CLI shape): a grpo stage
    kit import qlora-1b-kto.yaml                          # axolotl: the stage type from rl: (kto), else sft
    kit import my_sft.yaml --type dpo                     # say the trainer when the keys do not

Both shapes are flat: model, data, adapter and trainer settings side by side. Every key lands in the recipe, read
as the kit's (a comment names the source key where the name changed), or in a closing comment saying why it was
not carried over (a no-op, a setting the kit spells otherwise, or a name it does not know). The recipe opens with
the command that runs it and the file it came from; `kit check OUT` then checks it like any recipe.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from kitcli.errors import KitError

# the TRL CLI's registry (trl/scripts/grpo.py): name -> the factory's arguments it passes
TRL_REWARDS = {"accuracy_reward": {}, "reasoning_accuracy_reward": {}, "think_format_reward": {},
               "get_soft_overlong_punishment": {"max_completion_len": 1280, "soft_punish_cache": 256}}
# open-r1's registry (src/open_r1/rewards.py): name -> (function, {factory argument: (script argument, default)})
OPEN_R1_REWARDS: dict[str, tuple[str, dict[str, tuple[str, Any]]]] = {
    "accuracy": ("accuracy_reward", {}), "format": ("format_reward", {}),
    "reasoning_steps": ("reasoning_steps_reward", {}), "tag_count": ("tag_count_reward", {}),
    "length": ("len_reward", {}),
    "cosine": ("get_cosine_scaled_reward", {"min_value_wrong": ("cosine_min_value_wrong", 0.0),
                                            "max_value_wrong": ("cosine_max_value_wrong", -0.5),
                                            "min_value_correct": ("cosine_min_value_correct", 0.5),
                                            "max_value_correct": ("cosine_max_value_correct", 1.0),
                                            "max_len": ("cosine_max_len", 1000)}),
    "repetition_penalty": ("get_repetition_penalty_reward", {"ngram_size": ("repetition_n_grams", 3),
                                                             "max_penalty": ("repetition_max_penalty", -1.0)}),
    "code_format": ("get_code_format_reward", {"language": ("code_language", "python")}),
}
AXOLOTL_RL = {"dpo": "dpo", "ipo": "dpo", "kto": "kto", "orpo": "orpo", "simpo": "simpo", "grpo": "grpo"}
AXOLOTL_ONLY = {"base_model", "micro_batch_size", "num_epochs", "sequence_len", "adapter", "lora_target_linear",
                "val_set_size", "rl", "datasets", "dataset_prepared_path"}
TYPE_ORDER = ("sft", "grpo", "dpo", "kto", "orpo", "simpo", "rloo", "reward", "gspo")


class Imported:
    """The recipe being built, with a comment for the keys that came from elsewhere and the keys left out."""

    def __init__(self, source: Path, shape: str) -> None:
        self.source, self.shape = source, shape
        self.comments: dict[tuple, str] = {}
        self.dropped: list[str] = []
        self.empty: list[str] = []  # keys with no value in the source (axolotl's examples list many)
        self.mapped = 0

    def drop(self, key: str, value: Any, why: str) -> None:
        self.dropped.append(f"{key}: {shown_value(value)} -- {why}")


def detect_shape(raw: dict[str, Any]) -> str:
    if "model_name_or_path" in raw:
        return "TRL CLI"
    if AXOLOTL_ONLY & set(raw):
        return "axolotl"
    raise KitError("not a TRL CLI / open-r1 config (no model_name_or_path) nor an axolotl config (no base_model, "
                   "micro_batch_size, datasets, ...); kit import reads those two shapes")


def stage_type_of(raw: dict[str, Any], shape: str, given: str | None) -> tuple[str, str]:
    """The stage type and why: --type, axolotl's rl:, or the trainer whose config has the source's keys."""
    from kitcli.recipe import stage_types
    from kitcli.recipe.config_fields import config_fields

    trainers = {t: s for t, s in stage_types.specs().items() if s.config_name}
    if given is not None:
        if given not in trainers:
            raise KitError(f"--type {given}: one of {', '.join(trainers)}")
        return given, "--type"
    if shape == "axolotl":
        if raw.get("rl"):
            if raw["rl"] not in AXOLOTL_RL:
                raise KitError(f"rl: {raw['rl']}: the kit has no such stage; give --type (one of "
                               f"{', '.join(trainers)})")
            return AXOLOTL_RL[raw["rl"]], f"rl: {raw['rl']}"
        return ("reward", "reward_model: true") if raw.get("reward_model") is True else ("sft", "no rl: (axolotl SFT)")
    rewarded = {"reward_funcs", "reward_model_name_or_path"}  # the TRL scripts that take rewards: grpo, rloo
    fields = {t: set(config_fields(s.config)) | (rewarded if t in ("grpo", "rloo") else set())
              for t, s in trainers.items()}
    keys = set(raw) - set(config_fields("TrainingArguments"))
    weight = {k: 1 / n for k in keys if (n := sum(k in f for f in fields.values()))}  # a rarer key says more
    score = {t: sum(weight[k] for k in keys & fields[t]) for t in fields}
    order = [t for t in TYPE_ORDER if t in fields] + [t for t in fields if t not in TYPE_ORDER]
    best = max(order, key=lambda t: (score[t], -order.index(t)))
    if score[best] == 0:
        return "sft", "no trainer-specific key: SFT assumed (--type to say)"
    told = sorted(keys & fields[best], key=lambda k: (-weight[k], k))[:4]
    return best, f"from {', '.join(told)} (--type to say otherwise)"


def reward_specs(raw: dict[str, Any], done: set[str], imported: Imported) -> list[Any]:
    """reward_funcs as the kit's rewards: TRL's registry as trl.rewards:NAME, open-r1's as open_r1.rewards:NAME
    (with its script arguments as the factory's args), a dotted path as module:function."""
    names = raw.get("reward_funcs") or []
    weights = raw.get("reward_weights")
    specs: list[Any] = []
    for index, name in enumerate(names if isinstance(names, list) else [names]):
        spec: dict[str, Any]
        if name in TRL_REWARDS:
            spec = {"name": f"trl.rewards:{name}", **({"args": TRL_REWARDS[name]} if TRL_REWARDS[name] else {})}
        elif name in OPEN_R1_REWARDS:
            function, arguments = OPEN_R1_REWARDS[name]
            args = {arg: raw.get(key, default) for arg, (key, default) in arguments.items()}
            done.update(key for key, _ in arguments.values())
            spec = {"name": f"open_r1.rewards:{function}", **({"args": args} if args else {})}
        elif isinstance(name, str) and "." in name and ":" not in name:
            module, _, function = name.rpartition(".")
            spec = {"name": f"{module}:{function}"}
        elif isinstance(name, str) and ":" in name:
            spec = {"name": name}
        else:
            imported.drop(f"reward_funcs[{index}]", name, "neither TRL's reward registry, open-r1's nor an import "
                                                          "path; name a kit reward (kit rewards list) in rewards:")
            continue
        if isinstance(weights, list) and len(weights) == len(names):
            spec["weight"] = weights[index]
        specs.append(spec if set(spec) != {"name"} else spec["name"])
    done.update({"reward_funcs", "reward_weights"} & set(raw))
    if isinstance(weights, list) and len(weights) != len(names):
        imported.drop("reward_weights", weights, f"{len(weights)} weights for {len(names)} rewards; give each "
                                                 f"reward its weight: in rewards:")
    return specs


def data_of(raw: dict[str, Any], shape: str, done: set[str], imported: Imported) -> dict[str, Any] | None:
    """A list of datasets (axolotl's, the TRL CLI's mixture): the first as the stage's data, the rest noted."""
    datasets = raw.get("datasets")
    if not isinstance(datasets, list) or not datasets or "dataset_name" in raw:
        return None
    done.add("datasets")
    first = datasets[0] if isinstance(datasets[0], dict) else {"path": datasets[0]}
    data = {"path": first.get("path")}
    if first.get("split"):
        data["split"] = first["split"]
    if first.get("name"):
        data["config"] = first["name"]
    for key, value in first.items():
        if key not in ("path", "split", "name") and value is not None:
            why = ("axolotl's prompt format; the kit reads TRL's columns (prompt/completion, messages, text, "
                   "chosen/rejected, label): rename with data.columns or convert the file") if key == "type" else \
                "not a data setting of the kit (data: path, split, config, columns, limit, chat)"
            imported.drop(f"datasets[0].{key}", value, why)
    for index, extra in enumerate(datasets[1:], start=1):
        imported.drop(f"datasets[{index}]", extra, "a stage reads one dataset; add a stage (init: the one before) "
                                                   "or merge the files")
    imported.comments[("stages", 0, "data")] = f"<- datasets[0] ({shape})"
    return data


def build(raw: dict[str, Any], source: Path, given_type: str | None) -> tuple[dict[str, Any], Imported, str]:
    """The recipe, its comments and dropped keys, and why the stage has its type."""
    from kitcli.recipe import stage_types
    from kitcli.recipe.config_fields import config_fields
    from kitcli.recipe.foreign_names import translate

    shape = detect_shape(raw)
    imported = Imported(source, shape)
    stage_type, why_type = stage_type_of(raw, shape, given_type)
    done: set[str] = {"rl"} if shape == "axolotl" else set()
    if isinstance(raw.get("trl"), dict):  # axolotl's trainer section: its keys are the trainer's
        imported.drop("trl", raw["trl"], "axolotl's trainer section: its keys are read as the stage's (above)")
        raw = {**{k: v for k, v in raw.items() if k != "trl"}, **raw["trl"]}
    stage: dict[str, Any] = {"name": stage_type, "type": stage_type}
    imported.comments[("stages", 0, "type")] = f"<- {why_type}"
    data = data_of(raw, shape, done, imported)
    if data is not None:
        stage["data"] = data
    if raw.get("reward_funcs"):
        stage["rewards"] = reward_specs(raw, done, imported)
        weights = f"; reward_weights: {', '.join(map(str, raw['reward_weights']))}" \
            if isinstance(raw.get("reward_weights"), list) else ""
        imported.comments[("stages", 0, "rewards")] = \
            f"<- reward_funcs: {', '.join(map(str, raw['reward_funcs']))}{weights}"
    if raw.get("rl") == "ipo":
        raw = {**raw, "loss_type": ["ipo"]}
    recipe: dict[str, Any] = {"name": re.sub(r"[^a-z0-9_-]+", "-", source.stem.lower()).strip("-") or "imported",
                              "description": f"imported by kit import from {source.name} ({shape})"}
    if "seed" in raw:
        recipe["seed"] = raw["seed"]
        done.add("seed")
    recipe["model"] = {}
    peft_key = "use_peft" if shape == "TRL CLI" else "adapter"
    if peft_key not in raw:
        raw = {peft_key: None, **raw}  # unset: both tools then train every weight (read first: lora_r is then unused)
    cli_dropout = shape == "TRL CLI" and raw[peft_key] is True and "lora_dropout" not in raw
    if cli_dropout:
        raw = {**raw, "lora_dropout": 0.05}  # the TRL CLI's default (ModelConfig), not the kit's 0.0
    if "output_dir" in raw:
        imported.drop("output_dir", raw["output_dir"], "checkpoints go to the run directory's stage folder "
                                                       "(kit run -o DIR)")
        done.add("output_dir")
    stage["train"] = {}
    for key, value in raw.items():
        if key in done:
            continue
        if value is None and key != peft_key:
            imported.empty.append(key)
            continue
        stage["train"][key] = value
    recipe["stages"] = [stage]
    recipe, handled = translate(recipe)
    for h in handled:
        if h.does == "map":
            imported.mapped += 1
            path, note = comment_path(h.target), f"<- {h.key}: {shown_value(h.value)} [{h.record.source}]"
            imported.comments[path] = f"{imported.comments[path]}; {note}" if path in imported.comments else note
        else:
            from kitcli.recipe.foreign_names import shown

            reason = h.line.removeprefix(f"{h.where}: ").removeprefix(shown(h.value)).strip()
            imported.drop(h.key, h.value, reason.removeprefix("is "))
    stage = recipe["stages"][0]
    known = set(config_fields(stage_types.spec(stage_type).config))
    for key in [k for k in stage.get("train", {}) if k not in known]:
        imported.drop(key, stage["train"].pop(key), f"not a {stage_types.spec(stage_type).config_name} field nor a "
                                                    f"name the kit knows from another tool")
    if not stage.get("train"):
        stage.pop("train", None)
    recipe = ordered(recipe, ("name", "description", "seed", "model", "lora", "stages"))
    stage = ordered(stage, ("name", "type", "data", "rewards", "reward_model", "system_prompt"), ("train",))
    recipe["stages"] = [stage]
    if cli_dropout:
        imported.comments[("lora", "dropout")] = "unset in the source: the TRL CLI's default (ModelConfig), not the " \
                                                 "kit's 0.0"
    if shape == "TRL CLI" and raw[peft_key] is True and "lora_target_modules" not in raw:
        imported.comments[("lora",)] = "target_modules unset in the source: PEFT's default for the architecture " \
                                       "(q_proj, v_proj for Llama and Qwen); the kit's default adapts every projection"
    if recipe.get("lora") is False:
        imported.comments[("lora",)] = (f"{peft_key} unset: {shape} trains every weight; remove this line to train "
                                        f"a LoRA adapter (the kit's default)")
    if shape == "TRL CLI" and "dtype" not in recipe["model"]:
        imported.comments[("model",)] = "the TRL CLI loads float32 weights when dtype is unset; auto loads the " \
                                        "checkpoint's own dtype"
    return recipe, imported, why_type


def ordered(mapping: dict[str, Any], first: tuple[str, ...], last: tuple[str, ...] = ()) -> dict[str, Any]:
    keys = [k for k in first if k in mapping] + [k for k in mapping if k not in first and k not in last]
    return {k: mapping[k] for k in keys + [k for k in last if k in mapping]}


def comment_path(target: str) -> tuple:
    if target.startswith(("model", "lora")):
        return tuple(target.split("."))
    return ("stages", 0, *target.split("."))


def shown_value(value: Any) -> str:
    from kitcli.recipe.foreign_names import shown

    return shown(value, 60)


# --- the file ----------------------------------------------------------------------------------------------------

def render(recipe: dict[str, Any], imported: Imported, out: Path, why_type: str) -> str:
    """The recipe as YAML, opening with how to run it and where it came from, every moved key commented."""
    head = [f"# kit run {out}",
            f"# Imported by `kit import` from {imported.source} ({imported.shape} config); stage type "
            f"{recipe['stages'][0]['type']}: {why_type}.",
            f"# Tested: not yet; `kit check {out}` checks it here, `kit run {out} --dry-run` prints every setting.",
            "# A comment '<- KEY' names the source key a setting was read from; the keys not carried over close "
            "the file."]
    body = lines_of(recipe, (), 0, imported.comments)
    import textwrap

    tail = [f"#   {line}" for line in imported.dropped]
    if imported.empty:
        tail += textwrap.wrap(f"empty there: {', '.join(imported.empty)}", 116, initial_indent="#   ",
                              subsequent_indent="#     ")
    if tail:
        tail.insert(0, f"# Not carried over from {imported.source.name}:")
    return "\n".join(head + body + tail) + "\n"


def lines_of(mapping: dict[str, Any], path: tuple, indent: int, comments: dict[tuple, str]) -> list[str]:
    import yaml

    pad, lines = " " * indent, []
    for key, value in mapping.items():
        here, note = (*path, key), comments.get((*path, key))
        if key == "stages" and not path:
            lines.append(with_note(f"{pad}stages:", note))
            for index, stage in enumerate(value):
                inner = lines_of(stage, (*here, index), indent + 4, comments)
                lines += [f"{pad}  - {inner[0].lstrip()}", *inner[1:]]
            continue
        if isinstance(value, dict) and value:
            lines.append(with_note(f"{pad}{key}:", note))
            lines += lines_of(value, here, indent + 2, comments)
            continue
        if isinstance(value, (list, dict)):  # a list (or an empty mapping) on one line, in flow style
            flow = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9, allow_unicode=True)
            line = f"{pad}{key}: {flow.strip()}"
        else:  # a scalar; a string with line breaks is one double-quoted line
            line = pad + yaml.safe_dump({key: value}, default_flow_style=False, width=10**9,
                                        allow_unicode=True).rstrip("\n")
        lines.append(with_note(line, note))
    return lines


def with_note(line: str, note: str | None) -> str:
    return f"{line}  # {note}" if note else line


@click.command("import")
@click.argument("source", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="The recipe to write (default: SOURCE's name with -kit.yaml, in the working directory).")
@click.option("--type", "stage_type", help="The stage type (default: from the keys; axolotl: from rl:).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
def import_command(source: Path, output: Path | None, stage_type: str | None, force: bool) -> None:
    """Turn a TRL CLI / open-r1 or axolotl YAML config into a kit recipe (docs/foreign-names.md)."""
    from kitcli.recipe.load import parse_yaml, read_yaml

    if not source.is_file():
        raise KitError(f"'{source}' does not exist; give a TRL CLI / open-r1 or axolotl YAML file")
    raw = read_yaml(source)
    if not isinstance(raw, dict):
        raise KitError(f"{source}: a config is a YAML mapping of settings")
    output = output or Path(f"{source.stem}-kit.yaml")
    if output.resolve() == source.resolve() or (output.exists() and not force):
        raise KitError(f"{output} exists; give another --output or --force to overwrite it")
    recipe, imported, why_type = build(raw, source, stage_type)
    text = render(recipe, imported, output, why_type)
    if parse_yaml(text) != recipe:  # the comments must never change what the recipe says
        raise RuntimeError(f"kit import wrote YAML that does not read back as the recipe it built:\n{text}")
    output.write_text(text, encoding="utf-8")
    click.echo(f"wrote {output}: {imported.shape} config, stage type {recipe['stages'][0]['type']} ({why_type}); "
               f"{imported.mapped} keys read as the kit's, {len(imported.dropped)} not carried over and "
               f"{len(imported.empty)} empty (comments at its end); next: kit check {output}")
