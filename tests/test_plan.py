"""`kit plan`: architectures from config, the estimate against Unsloth's published figures, fitting a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from helpers import DATA, run_cli, write_recipe

from kitcli.commands import plan
from kitcli.errors import KitError

# Unsloth's context-length benchmark (unsloth.ai/docs/basics/unsloth-benchmarks): Llama 3.1 8B Instruct, 4-bit
# QLoRA on all linear layers, rank 32, batch 1: the longest sequence that fits each GPU.
SFT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl")}
UNSLOTH_LLAMA8B_MAX_CONTEXT = {8: 2972, 12: 21848, 16: 40724, 24: 78475, 40: 153977, 48: 191728, 80: 342733}


@pytest.mark.parametrize("name, billions", [
    ("Qwen/Qwen3-0.6B", 0.596), ("Qwen/Qwen3-1.7B", 1.72), ("unsloth/Qwen3-4B-Base", 4.02), ("Qwen/Qwen3-8B", 8.19),
    ("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit", 8.03), ("meta-llama/Llama-3.2-1B-Instruct", 1.24),
    ("unsloth/Llama-3.2-3B-Instruct", 3.21), ("google/gemma-3-4b-it", 4.3), ("mistralai/Mistral-7B-v0.3", 7.25),
])
def test_builtin_architectures_give_the_published_parameter_counts(name, billions):
    arch = plan.find_architecture(name)
    assert "built-in" in arch.source or "hub cache" in arch.source
    assert arch.total_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_tiny_and_local_configs_are_read(tmp_path, tiny_model_dir):
    tiny = plan.find_architecture("tiny")
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.vocab_size) == (128, 4, 320)
    local = plan.find_architecture(str(tiny_model_dir))
    assert local.source.endswith("config.json") and local.total_params == tiny.total_params
    nested = {"text_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "intermediate_size": 128, "vocab_size": 100}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert plan.find_architecture("anything", config_path=str(tmp_path)).head_dim == 16


@pytest.mark.parametrize("gpu_gib, tokens", sorted(UNSLOTH_LLAMA8B_MAX_CONTEXT.items()))
def test_estimate_matches_unsloth_max_context_benchmark(gpu_gib, tokens):
    """At the longest sequence Unsloth fits on a GPU, the estimated peak is that GPU's memory (within 8%)."""
    arch = plan.find_architecture("meta-llama/Llama-3.1-8B-Instruct")
    settings = plan.Settings(stage_type="sft", backend="unsloth", lora_r=32, per_device_train_batch_size=1,
                             seq_len=tokens)
    peak = plan.estimate(arch, settings).peak / plan.GiB
    assert peak == pytest.approx(gpu_gib, rel=0.08)


def test_estimate_terms_move_the_right_way():
    arch = plan.find_architecture("unsloth/Qwen3-4B-Base")
    base = plan.Settings(stage_type="grpo", backend="transformers", per_device_train_batch_size=8, num_generations=8,
                         prompt_len=256, completion_len=512, seq_len=768, gradient_checkpointing=False)

    def peak(**changes):
        return plan.estimate(arch, plan.replace(base, **changes)).peak

    assert peak(gradient_checkpointing=True) < peak()
    assert peak(backend="unsloth", gradient_checkpointing=True) < peak(gradient_checkpointing=True)
    assert peak(per_device_train_batch_size=4) < peak()
    assert peak(load_in_4bit=False) > peak() + 4 * plan.GiB  # 4B parameters: ~2 bytes each instead of ~0.5
    parts = {c.name.split(" (")[0] for c in plan.estimate(arch, plan.replace(base, reward_model=True)).components}
    assert {"KV cache", "reward model", "logits", "activations"} <= parts
    dpo = plan.estimate(arch, plan.Settings(stage_type="dpo", lora_r=None, load_in_4bit=False))
    assert any(c.name == "reference model (full copy)" and c.bytes > 7 * plan.GiB for c in dpo.components)


# One stage of every built-in type (and every GRPO variant), as small as the recipe schema allows.
PROMPTS = {"data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"]}
SAMPLE_STAGES = {
    "sft": [{"data": str(DATA / "arithmetic_sft.jsonl")}],
    "reward": [{"data": str(DATA / "arithmetic_prefs.jsonl")}],
    "dpo": [{"data": str(DATA / "arithmetic_prefs.jsonl")}],
    "orpo": [{"data": str(DATA / "arithmetic_prefs.jsonl")}],
    "simpo": [{"data": str(DATA / "arithmetic_prefs.jsonl")}],
    "kto": [{"data": str(DATA / "arithmetic_prefs.jsonl")}],
    "grpo": [PROMPTS, *({**PROMPTS, "variant": v} for v in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo",
                                                            "vespo")),
             # train: sizes the generation batch, so the kit sets no steps_per_generation and TRL derives it
             {**PROMPTS, "train": {"gradient_accumulation_steps": 2, "generation_batch_size": 16}}],
    "gspo": [PROMPTS, {**PROMPTS, "variant": "luspo"}],
    "rloo": [PROMPTS],
    "ppo": [PROMPTS],
    "distill": [{"data": PROMPTS["data"], "teacher": {"model": "tiny"}}],
    "eval": [{"data": str(DATA / "arithmetic_eval.jsonl")}],
}


def fake_gpu_torch(monkeypatch):
    """A `torch` whose GPU has bfloat16, so kitcli.training.trl_config.device_defaults(on_gpu=True) runs here.
    Everything else is the real torch's, so that a trainer config built with the GPU's values (bf16) constructs too:
    transformers' TrainingArguments checks bf16 through a late `import torch` (this one) and keeps the CPU as its
    device (its module's own torch is the real one)."""
    import torch as real

    class Torch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real, name)

    torch = Torch("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, is_bf16_supported=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", torch)


def test_planner_gpu_device_defaults_are_the_kits(monkeypatch):
    from kitcli.plan.settings import GPU_DEVICE_DEFAULTS
    from kitcli.training.trl_config import device_defaults

    fake_gpu_torch(monkeypatch)
    assert device_defaults(on_gpu=True) == GPU_DEVICE_DEFAULTS


# Every built-in stage type has a sample here: tests/test_stage_coverage.py checks it and names what to add.


def stage_config(ctx, stage_type: str):
    """The trainer config the stage builds, the way its run builds it (its module's make_config, which calls
    kitcli.training.trl_config.build_config); under `fake_gpu_torch`, the one it builds on a bf16 GPU."""
    from kitcli.recipe import stage_types

    module = stage_types.module(stage_type)
    if stage_type not in ("grpo", "gspo", "rloo"):
        return module.make_config(ctx)
    grpo = stage_types.module("grpo")
    preset = {"grpo": lambda: grpo.VARIANTS[grpo.variant_name(ctx)], "gspo": lambda: module.preset(ctx),
              "rloo": lambda: module.RLOO_PRESET}[stage_type]()
    # grpo.py builds GRPO, GSPO (GRPOTrainer) and RLOO configs by the stage's StageSpec
    return grpo.make_config(ctx, grpo.resolved_defaults(ctx, preset, grpo.load_reward_functions(ctx)))


def without_unsloth_cpu_defaults(monkeypatch, config_cls) -> None:
    """Unsloth wraps the configs' __post_init__ with its CPU training defaults (unsloth_zoo.cpu.trainer: use_cpu,
    a CPU AdamW in place of adamw_8bit) in a CPU process only; take the wrapper off, as a GPU process has it."""
    for cls in config_cls.__mro__:
        post_init = vars(cls).get("__post_init__")
        if getattr(post_init, "_unsloth_cpu", False):
            monkeypatch.setattr(cls, "__post_init__", post_init.__wrapped__)


def sample_id(value):
    if isinstance(value, str):
        return value
    return value.get("variant") or "+".join(value.get("train", {})) or "default"


# train: sizes the generation batch: TRL derives steps_per_generation = generation_batch_size / per-device batch
# (4), which the planner once gave as gradient_accumulation_steps (1).
GENERATION_BATCH = pytest.param("grpo", {**PROMPTS, "train": {"generation_batch_size": 32}},
                                id="grpo-generation_batch_size-32")


@pytest.mark.parametrize("stage_type, body", [*((t, b) for t, bodies in SAMPLE_STAGES.items() for b in bodies),
                                              GENERATION_BATCH], ids=sample_id)
def test_planner_settings_are_the_stage_config_on_a_gpu(in_tmp, monkeypatch, stage_type, body):
    """plan's settings are the fields of the trainer config the stage itself builds on a GPU with bfloat16 (read
    after its __post_init__ has run: TRL settles steps_per_generation and generation_batch_size there), not the
    defaults the planner merges: a planner that merged the wrong layers, or a config that rewrites a value, shows
    here. The config is the real TRL (or kit PPO) class, built with bf16 and adamw_8bit; only torch's report of a
    GPU is faked (`fake_gpu_torch`, transformers still places the config on the CPU) and Unsloth's CPU-only wrapper
    of __post_init__, which swaps adamw_8bit for a CPU AdamW, is taken off (`without_unsloth_cpu_defaults`)."""
    from rich.console import Console

    from kitcli.recipe import stage_types
    from kitcli.recipe.load import load_recipe
    from kitcli.recipe.stage_context import StageContext
    from kitcli.training.trainers import config_class
    from kitcli.training.trl_config import canonical

    path = write_recipe(in_tmp / "r.yaml", [{"name": "s", "type": stage_type, **body}])
    recipe = load_recipe(str(path))
    stage = recipe.stage("s")
    ctx = StageContext(recipe, stage, in_tmp / "run", Console(quiet=True), {})
    spec = stage_types.spec(stage_type)
    max_seq_length = recipe.model.max_seq_length
    config = None
    if not spec.evaluates:
        if spec.trainer:  # TRL is imported with the real torch; the stage then finds it loaded
            without_unsloth_cpu_defaults(monkeypatch, config_class(spec))
        fake_gpu_torch(monkeypatch)
        config = stage_config(ctx, stage_type)
    monkeypatch.setitem(sys.modules, "torch", None)  # planning itself must not import torch
    settings = plan.stage_settings(recipe, stage, "unsloth")

    if spec.evaluates:
        generation = stage_types.module(stage_type).generation_settings(ctx)
        assert settings.completion_len == generation["max_new_tokens"]
        assert settings.eval_batch_size == generation["batch_size"]
        assert settings.prompt_len == max_seq_length
        return
    assert config.bf16 and not config.fp16 and not config.use_cpu  # what the stage builds on a GPU
    assert settings.optim == canonical(config.optim)
    if stage_type == "ppo":  # one response per prompt of a rollout of per_device_train_batch_size prompts
        rollout = config.per_device_train_batch_size
        assert settings.critic and settings.num_generations == 1
        assert settings.generation_batch_size == settings.completions_at_once == rollout
        assert settings.per_device_train_batch_size == rollout // config.num_mini_batches
        assert settings.completion_len == config.response_length
        assert settings.seq_len == settings.prompt_len + config.response_length
        assert settings.beta == config.kl_coef
        return
    assert not settings.critic
    assert settings.gradient_checkpointing == config.gradient_checkpointing
    assert settings.per_device_train_batch_size == config.per_device_train_batch_size
    assert settings.gradient_accumulation_steps == config.gradient_accumulation_steps
    assert settings.beta == getattr(config, "beta", 0.0)  # SFT and reward configs have none
    if stage_type == "grpo":
        grpo = stage_types.module("grpo")
        assert settings.beta == grpo.VARIANTS[body.get("variant", grpo.DEFAULT_VARIANT)]["beta"]
    if not spec.rl:  # a sequence (a chosen + rejected pair for preference stages) up to max_length
        assert settings.seq_len == (config.max_length or max_seq_length)
        return
    if stage_type == "distill":  # one completion per prompt, a generation batch each optimizer step; a teacher
        assert settings.num_generations == 1 and settings.frozen_model == "tiny"
        assert settings.completion_len == config.max_completion_length
        assert settings.seq_len == settings.prompt_len + config.max_completion_length
        assert settings.completions_at_once == config.per_device_train_batch_size * config.gradient_accumulation_steps
        return
    assert settings.num_generations == config.num_generations
    assert settings.completion_len == config.max_completion_length
    assert settings.seq_len == settings.prompt_len + config.max_completion_length
    assert settings.steps_per_generation == config.steps_per_generation
    assert settings.completions_at_once == config.generation_batch_size
    assert settings.generation_batch_size in (None, config.generation_batch_size)


def test_plan_imports_no_heavy_module():
    heavy = ("torch", "transformers", "trl", "unsloth", "peft", "datasets")
    code = ("import sys, json\n"
            "from kitcli.commands.cli import main\n"
            "for recipe in ('tiny-grpo', 'recipes/qwen3-4b-ppo.yaml'):\n"
            "    try:\n"
            "        main(['plan', recipe, '--gpu-memory', '24GB', '--json'], prog_name='kit')\n"
            "    except SystemExit as stop:\n"
            "        assert not stop.code, stop.code\n"
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=DATA.parent.parent)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def qwen_recipe(path):
    stages = [
        {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
         "train": {"per_device_train_batch_size": 8}},
        {"name": "grpo", "type": "grpo", "init": "sft", "data": str(DATA / "arithmetic_prompts.jsonl"),
         "rewards": ["exact_match"], "train": {"per_device_train_batch_size": 16, "num_generations": 16,
                                              "max_completion_length": 2048}},
    ]
    return write_recipe(path, stages, model={"name": "unsloth/Qwen3-4B-Base", "max_seq_length": 4096},
                        lora={"r": 64})


def test_plan_says_what_fits_and_what_to_change(in_tmp):
    recipe = qwen_recipe(in_tmp / "qwen.yaml")
    small = run_cli("plan", recipe, "--gpu-memory", "12GB")
    assert "qwen3-4b" in small.output and "12.0 GiB" in small.output
    assert "does not fit" in small.output
    assert "--set stages.grpo.train.per_device_train_batch_size=" in small.output
    assert "new estimate" in small.output

    data = json.loads(run_cli("plan", recipe, "--gpu-memory", "12GB", "--json").stdout)
    grpo = next(s for s in data["stages"] if s["stage"] == "grpo")
    assert grpo["fits"] is False and grpo["suggestion"]["fits"] is True
    assert grpo["suggestion"]["peak_gib"] <= 12 < grpo["peak_gib"]
    kv = next(c for c in grpo["components"] if c["name"].startswith("KV cache"))
    assert "16 completions x 4096 tokens" in kv["name"]

    big = json.loads(run_cli("plan", recipe, "--gpu-memory", "80GB", "--json").stdout)
    assert all(s["fits"] for s in big["stages"])


def test_plan_gives_the_peak_at_the_length_a_filter_found_completions_cut_at(in_tmp):
    """A run whose GRPO filter found most sampled completions cut at max_completion_length (the summary the filter
    writes; tests/test_filter.py has kit plan read a real one): the plan adds the peak at twice that length, the
    figure a plan with that length set gives, and says nothing when few were cut."""
    recipe = qwen_recipe(in_tmp / "qwen.yaml")
    summary = in_tmp / "run" / "grpo" / "filter" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text(json.dumps({"truncated_share_before": 0.4, "max_completion_length": 2048}))
    grpo = next(s for s in json.loads(run_cli("plan", recipe, "--gpu-memory", "24GB", "-o", in_tmp / "run",
                                              "--json").stdout)["stages"] if s["stage"] == "grpo")
    longer = json.loads(run_cli("plan", recipe, "--gpu-memory", "24GB", "--json", "--set", "model.max_seq_length=6144",
                                "--set", "stages.grpo.train.max_completion_length=4096").stdout)["stages"][1]
    assert grpo["measured"]["longer"] == {"max_completion_length": 4096, "peak_gib": longer["peak_gib"],
                                          "fits": longer["fits"]}
    assert longer["peak_gib"] > grpo["peak_gib"]
    text = run_cli("plan", recipe, "--gpu-memory", "24GB", "-o", in_tmp / "run").output
    assert "measured: 40% of the starting policy's sampled completions reached max_completion_length 2048" in text
    summary.write_text(json.dumps({"truncated_share_before": 0.01, "max_completion_length": 2048}))
    grpo = json.loads(run_cli("plan", recipe, "-o", in_tmp / "run", "--json").stdout)["stages"][1]
    assert grpo["measured"]["truncated_share"] == 0.01 and "longer" not in grpo["measured"]


def test_plan_suggestion_is_applied_by_set(in_tmp):
    recipe = qwen_recipe(in_tmp / "qwen.yaml")
    data = json.loads(run_cli("plan", recipe, "--gpu-memory", "12GB", "--json").stdout)
    flags = next(s for s in data["stages"] if s["stage"] == "grpo")["suggestion"]["set"]
    values = [f.split(" ", 1)[1] for f in flags]
    again = json.loads(run_cli("plan", recipe, "--gpu-memory", "12GB", "--json",
                               *[a for v in values for a in ("--set", v)]).stdout)
    assert next(s for s in again["stages"] if s["stage"] == "grpo")["fits"] is True
    dry = run_cli("run", recipe, "--dry-run", *[a for v in values for a in ("--set", v)])  # TRL accepts them
    assert "GRPOConfig:" in dry.output


def test_plan_of_shipped_tiny_recipe_without_gpu():
    result = run_cli("plan", "tiny-sft")
    assert "embedded tiny model" in result.output
    assert "stage sft (sft)" in result.output and "summary" in result.output


def test_plan_without_config_is_one_line_error(in_tmp):
    recipe = write_recipe(in_tmp / "r.yaml", [SFT], model={"name": "someone/unheard-of-model-7b"})
    result = run_cli("plan", recipe, "--gpu-memory", "24GB", expect=2)
    assert result.output.startswith("Error: cannot find a config for model 'someone/unheard-of-model-7b'")
    assert "--config" in result.output and "huggingface-cli download" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_plan_with_config_option(in_tmp):
    recipe = write_recipe(in_tmp / "r.yaml", [SFT], model={"name": "someone/unheard-of-model-7b"})
    (in_tmp / "config.json").write_text(json.dumps(plan.BUILTIN_ARCHITECTURES["mistral-7b"]))
    data = json.loads(run_cli("plan", recipe, "--config", in_tmp / "config.json", "--json").stdout)
    assert data["parameters_b"] == pytest.approx(7.25, rel=0.01)


@pytest.mark.parametrize("text, gib", [("12GB", 12), ("24GiB", 24), ("80", 80), ("16384MB", 16), ("0.5 G", 0.5)])
def test_parse_memory(text, gib):
    assert plan.parse_memory(text) == gib * plan.GiB


def test_bad_memory_size_is_an_error(in_tmp):
    with pytest.raises(KitError, match="not a memory size"):
        plan.parse_memory("lots")
    result = run_cli("plan", "tiny-sft", "--gpu-memory", "twelve", expect=2)
    assert "12GB" in result.output

