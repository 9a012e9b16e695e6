"""The recipe's typed model (pydantic): what every key is, its type and range, and what a stage type is.

Sections shared by every recipe live here (`ModelSpec`, `LoraSpec`, `DataSpec`, `RewardSpec`, `RewardModelSpec`,
`GenerationSpec`); each stage type declares its own section model and its `StageSpec`
(kitcli/recipe/stage_spec.py) in its module (`kitcli/stages/<type>.py`), and `kitcli/recipe/stage_types.py` collects
them. `validate_recipe` checks a whole recipe, `--set` overrides included, before anything heavy is imported: unknown
keys (with a "did you mean"), types, ranges, the `train:` block against the stage's trainer config
(kitcli/recipe/config_fields.py), and the rules between stages (`init:` and `reward_model:` name earlier stages of a
type they can use). A fault is one line naming file and key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kitcli.errors import KitError, closest, did_you_mean
from kitcli.recipe.config_fields import TRAINING_RANGES, Range
from kitcli.recipe.held_out_spec import HeldOutSpec
from kitcli.recipe.paths import base_dir_of, resolve_data_path, resolve_model_name
from kitcli.recipe.stage_rules import check_stage_references, fail, misplaced_keys, stage_name
from kitcli.recipe.stage_spec import StageSpec

ALL_LINEAR = "all-linear"  # PEFT's shorthand (peft/utils/constants.py, INCLUDE_LINEAR_LAYERS_SHORTHAND)
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RESERVED_TRAIN = {"output_dir": "checkpoints go to the stage folder", "seed": "set the recipe's top-level seed"}


class Section(BaseModel):
    """Every recipe mapping: unknown keys are errors, values keep their YAML type (no '1' -> 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)


# --- sections ----------------------------------------------------------------------------------------------------

class ModelSpec(Section):
    """The base model every stage starts from."""

    name: str = Field(description="A hub name (org/model), a local model directory or .gguf file, `smollm2-135m` (a "
                                  "real 135M instruct model, installed offline) or `tiny` (the embedded model).")
    max_seq_length: Annotated[int, Field(gt=0)] = Field(1024, description="Longest sequence in tokens.")
    load_in_4bit: bool | None = Field(None, description="Load the base in 4-bit (QLoRA). Unset: 4-bit on a GPU, "
                                                        "16-bit on a CPU (where it trains faster).")
    backend: Literal["auto", "unsloth", "transformers"] = Field("auto", description="Who loads the model.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weight dtype.")
    trust_remote_code: bool = Field(False, description="Run the model repository's own Python code.")
    chat_template: str | None = Field(None, description="The chat template every stage, eval, chat, generate and "
                                                        "export use: a name Unsloth's get_chat_template knows "
                                                        "(chatml, llama-3.1, qwen-2.5, ...), a Jinja string, or a "
                                                        "file holding one. Unset: the tokenizer's own.")

    @model_validator(mode="before")
    @classmethod
    def shorthand(cls, raw: Any) -> Any:
        return {"name": raw} if isinstance(raw, str) else raw

    @field_validator("name", mode="after")
    @classmethod
    def resolve(cls, name: str, info: ValidationInfo) -> str:
        return resolve_model_name(name, base_dir_of(info))

    @field_validator("chat_template", mode="after")
    @classmethod
    def check_chat_template(cls, value: str | None, info: ValidationInfo) -> str | None:
        from kitcli.models.chat_template import resolve_chat_template  # a file becomes its absolute path

        try:
            return None if value is None else resolve_chat_template(value, base_dir_of(info),
                                                                    info.data.get("backend", "auto"))
        except KitError as error:
            raise fail(str(error), where="model.chat_template") from None


class LoraSpec(Section):
    """The LoRA adapter every stage trains (`lora: false`: full fine-tuning)."""

    r: Annotated[int, Field(gt=0)] = Field(16, description="Rank.")
    alpha: Annotated[float, Field(gt=0)] = Field(32, description="Scaling numerator (alpha / r).")
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(0.0, description="LoRA dropout.")
    target_modules: list[str] | str = Field(default_factory=lambda: list(DEFAULT_TARGETS),
                                            description="Module names to adapt, or 'all-linear'.")

    @field_validator("target_modules", mode="after")
    @classmethod
    def shorthand_alone(cls, targets: list[str] | str) -> list[str] | str:
        """PEFT reads its 'all-linear' shorthand only as the whole value (a list holding it names a module called
        'all-linear', which no model has): [all-linear] is read as all-linear; beside other names it is refused."""
        if isinstance(targets, list) and ALL_LINEAR in (t.lower() for t in targets):
            if len(targets) > 1:
                raise fail(f"'{ALL_LINEAR}' adapts every linear layer, so it stands alone: give "
                           f"target_modules: {ALL_LINEAR}, or a list of module names without it")
            return ALL_LINEAR
        return targets


class DataSpec(Section):
    """A dataset: a local JSONL / JSON / CSV / Parquet file, or a hub dataset name."""

    path: str = Field(description="File (relative to the recipe, the working directory or the kit) or hub name.")
    split: str = Field("train", description="Hub dataset split.")
    columns: dict[str, str] = Field(default_factory=dict, description="Renames: {its_column: the_stage_column}.")
    limit: Annotated[int, Field(gt=0)] | None = Field(None, description="Use only the first N rows.")
    config: str | None = Field(None, description="Hub dataset configuration.")
    chat: bool = Field(False, description="Turn plain-string prompt / completion / chosen / rejected columns into "
                                          "TRL's conversational format (user and assistant turns), so an instruct "
                                          "model's chat template formats them.")

    @model_validator(mode="before")
    @classmethod
    def shorthand(cls, raw: Any) -> Any:
        if isinstance(raw, str):
            return {"path": raw}
        if isinstance(raw, dict) and "columns" in raw and raw["columns"] is not None \
                and not isinstance(raw["columns"], dict):
            raise fail("columns must map dataset columns to the names the stage expects, e.g. {question: prompt}")
        if isinstance(raw, dict) and raw.get("columns") is None:
            raw = {**raw, "columns": {}}
        return raw

    @field_validator("path", mode="after")
    @classmethod
    def resolve(cls, path: str, info: ValidationInfo) -> str:
        return resolve_data_path(path, base_dir_of(info))


class RewardSpec(Section):
    """A reward function: a built-in name, `module:function`, or `path/to/file.py:function`."""

    name: str = Field(description="Which reward (`kit rewards list`).")
    args: dict[str, Any] = Field(default_factory=dict, description="A factory's arguments.")
    weight: float = Field(1.0, description="Its weight in the total reward.")
    on_error: Literal["raise", "skip"] = Field("raise", description="skip: score a failing sample None.")
    name_as: str | None = Field(None, description="The name it is logged under (two rewards of one name).")

    @model_validator(mode="before")
    @classmethod
    def shorthand(cls, raw: Any) -> Any:
        return {"name": raw} if isinstance(raw, str) else raw


class RewardModelSpec(Section):
    """A learned reward model: an earlier reward stage of this recipe, or a saved sequence-classification model."""

    stage: str | None = Field(None, description="An earlier stage of type reward.")
    path: str | None = Field(None, description="A directory with a sequence-classification model (one output).")
    weight: float = Field(1.0, description="Its weight in the total reward.")

    @model_validator(mode="before")
    @classmethod
    def shorthand(cls, raw: Any) -> Any:
        if isinstance(raw, str):
            return {"path": raw} if ("/" in raw or raw.startswith((".", "~"))) else {"stage": raw}
        return raw

    @model_validator(mode="after")
    def one_source(self, info: ValidationInfo) -> RewardModelSpec:
        if (self.stage is None) == (self.path is None):
            raise fail("reward_model is a reward stage name, or a mapping with 'stage' (or 'path' to a "
                       "sequence-classification model directory) and optional 'weight'")
        if self.path is not None:
            path = Path(self.path).expanduser()
            path = path if path.is_absolute() else base_dir_of(info) / path
            if not (path / "config.json").is_file():
                raise fail(f"reward_model path '{self.path}' is not a model directory (no config.json in {path}); "
                           f"give a saved AutoModelForSequenceClassification or a reward stage name")
            self.path = str(path.resolve())
        return self


class GenerationSpec(Section):
    """How an eval stage generates."""

    max_new_tokens: Annotated[int, Field(gt=0)] = Field(32, description="Most new tokens per completion.")
    batch_size: Annotated[int, Field(gt=0)] = Field(32, description="Prompts per generation batch.")
    temperature: Annotated[float, Field(ge=0)] = Field(0.0, description="0: greedy.")
    n: Annotated[int, Field(gt=0)] = Field(1, description="Samples per prompt (pass@k for k <= n).")
    show: Annotated[int, Field(ge=0)] = Field(3, description="Scored samples to print.")

    @model_validator(mode="after")
    def sampling(self) -> GenerationSpec:
        if self.n > 1 and self.temperature == 0:
            raise fail(f"generation.n is {self.n} but temperature is 0, so every sample would be the same greedy "
                       f"completion; set generation.temperature (e.g. 0.8) or n: 1")
        return self


# --- stages ------------------------------------------------------------------------------------------------------

class StageSection(Section):
    """Keys every stage has. A stage type's section model subclasses it and sets `type` to its name."""

    name: str | None = Field(None, description="The stage's name (its folder in the run directory).")
    init: str | None = Field(None, description="An earlier stage whose output this stage starts from.")
    spec: ClassVar[StageSpec | None] = None  # what its type is: set by the StageSpec that names this section


def declared(stage: StageSection, key: str) -> Any:
    """A key only some stage types have (`data`, `eval_data`, `rewards`, `tools` ...): its value where the stage's
    section declares it, else None."""
    return getattr(stage, key) if key in type(stage).model_fields else None


class TrainingSection(StageSection):
    """A stage that trains: its data and its trainer config's fields."""

    data: DataSpec = Field(description="The training data.")
    train: dict[str, Any] = Field(default_factory=dict, description="Fields of the stage's trainer config.")
    eval: HeldOutSpec[DataSpec, GenerationSpec, RewardSpec] | None = Field(None, description="Held-out evaluation "
                                                                           "while it trains (docs/stages.md).")
    reserved: ClassVar[dict[str, str]] = RESERVED_TRAIN
    # The kit's ranges and choices for train: fields, which no library declares (TrainingArguments' here; a stage
    # type's section adds its method's own). A config's declared choices (TRL's metadata) are read from it.
    train_ranges: ClassVar[dict[str, Range]] = TRAINING_RANGES
    train_choices: ClassVar[dict[str, Any]] = {}
    train_reasons: ClassVar[dict[str, str]] = {}  # why a field's range is the section's, said when a value is out of it

    @field_validator("train", mode="before")
    @classmethod
    def mapping(cls, raw: Any) -> Any:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise fail("'train' must be a mapping of TRL config fields")
        return raw

    @field_validator("train", mode="after")
    @classmethod
    def fields_and_values(cls, train: dict[str, Any]) -> dict[str, Any]:
        check_train(cls, train)
        return train


def check_train(section: type[TrainingSection], train: dict[str, Any]) -> None:
    """Every `train:` key is a field of the stage's config, of the right type and in the section's range: every
    faulty key is named (one line each), and set aside for the rest of the check (kitcli/recipe/faults.py)."""
    reserved = section.reserved
    if section.spec is None or section.spec.config is None:
        return
    from kitcli.recipe.config_fields import check_value, config_fields

    path, config = section.spec.config, section.spec.config_name
    names = config_fields(path)
    faults: dict[str, str] = {}
    bad_values = []  # keys the trainer reads, whose value was wrong (set aside, a default takes their place)
    for key, value in train.items():
        if key in reserved:
            faults[key] = f"train.{key} is set by the kit ({reserved[key]}); remove it"
        elif key not in names:
            faults[key] = f"train.{key} is not a {config} field{did_you_mean(key, names)}"
            if closest(key, names):  # a misspelled field: its default stands in for the value meant
                bad_values.append(key)
        elif (expected := check_value(path, key, value, section.train_ranges, section.train_choices)) is not None:
            faults[key] = (f"train.{key} must be {expected} ({section.train_reasons[key]}), got {value!r}"
                           if key in section.train_reasons else
                           f"{config} rejected the train settings: train.{key} must be {expected}, got {value!r}")
            bad_values.append(key)
    if faults:
        messages = list(faults.values())
        raise PydanticCustomError("kit", "{message}", {"message": messages[0], "where": None, "more": messages[1:],
                                                       "keys": list(faults), "values": bad_values})


class RewardedSection(TrainingSection):
    """A stage that samples completions and scores them: reward functions and/or a learned reward model."""

    rewards: list[RewardSpec] = Field(default_factory=list, description="Reward functions and their weights.")
    reward_model: RewardModelSpec | None = Field(None, description="A reward stage (or model directory) scoring "
                                                                    "each completion.")
    system_prompt: str | None = Field(None, description="A system message put before every prompt.")

    @field_validator("rewards", mode="before")
    @classmethod
    def reward_list(cls, raw: Any) -> Any:
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise fail("'rewards' must be a list of reward names or mappings")
        return raw

    @model_validator(mode="after")
    def some_reward(self):
        if not self.rewards and self.reward_model is None:
            raise fail(f"no rewards; {self.type.upper()} needs a reward: list reward functions under rewards: "
                       f"(e.g. - exact_match) and/or name a reward stage with reward_model:")
        return self


# --- the whole recipe ---------------------------------------------------------------------------------------------

def recipe_model(specs: dict[str, StageSpec]) -> type[BaseModel]:
    """The pydantic model of a recipe whose stages are these types (a union discriminated by `type`)."""
    from typing import Union

    sections = tuple(spec.section for spec in specs.values())
    Stage = Annotated[Union[sections], Field(discriminator="type")]  # noqa: UP007  (a runtime-built union)

    class Recipe(Section):
        """A recipe: a model, LoRA settings and the stages to run in order."""

        name: str | None = Field(None, description="The run's name (default: the file's name).")
        description: str = Field("", description="One line about the recipe.")
        seed: Annotated[int, Field(ge=0)] = Field(42, description="Seeds the model build, data order and sampling.")
        model: ModelSpec = Field(description="The base model.")
        lora: LoraSpec | None = Field(default_factory=LoraSpec, description="LoRA settings, or false for full "
                                                                             "fine-tuning.")
        check: Literal["warn", "strict"] | None = Field(None, description="strict: `kit check`'s findings "
                                                                          "stop `kit run` (default: warnings).")
        stages: list[Stage] = Field(description="The stages, run in order.")

        @model_validator(mode="before")
        @classmethod
        def structure(cls, raw: Any) -> Any:
            if not isinstance(raw, dict):
                raise fail("a recipe must be a YAML mapping with 'name', 'model' and 'stages'", where="")
            raw = dict(raw)
            if raw.get("model") is None:
                raise fail("'model' is missing; give a hub name, a local directory, or 'tiny'", where="")
            model = raw["model"]
            if not isinstance(model, (str, dict)) or (isinstance(model, dict) and "name" not in model):
                raise fail("'model' must be a name or a mapping with 'name' (and optional "
                           f"{', '.join(sorted(set(ModelSpec.model_fields) - {'name'}))})", where="")
            lora = raw.get("lora", {})
            if lora is False or lora == "none":
                raw["lora"] = None
            elif lora is None:
                raw["lora"] = {}
            elif not isinstance(lora, dict):
                raise fail(f"expected a mapping with {', '.join(sorted(LoraSpec.model_fields))}, or false for full "
                           f"fine-tuning", where="lora")
            stages = raw.get("stages")
            if not isinstance(stages, list) or not stages:
                raise fail("'stages' must be a non-empty list of stages, each with a 'name' and a 'type'", where="")
            for index, stage in enumerate(stages):
                where = f"stages[{index}]"
                if not isinstance(stage, dict):
                    raise fail("each stage must be a mapping with 'name' and 'type'", where=where)
                if stage.get("type") is None:
                    raise fail(f"'type' is missing; one of {', '.join(specs)}", where=where)
                if not isinstance(stage["type"], str):
                    raise fail(f"'type' must be a stage type's name, one of {', '.join(specs)}; got "
                               f"{stage['type']!r}", where=where)
                if stage["type"] not in specs:
                    raise fail(f"unknown stage type '{stage['type']}'{did_you_mean(str(stage['type']), specs)} "
                               f"(available: {', '.join(specs)})", where=where)
                misplaced_keys(stage, specs, f"stage '{stage_name(stage, index)}'")
            return raw

        @model_validator(mode="after")
        def between_stages(self) -> Recipe:
            check_stage_references(self.stages, specs)
            return self

    return Recipe
