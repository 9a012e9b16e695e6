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
    "kto": [{"data": str(DATA / "arithmetic_prefs.jsonl")}],
    "grpo": [PROMPTS, *({**PROMPTS, "variant": v} for v in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo",
                                                            "vespo"))],
    "gspo": [PROMPTS, {**PROMPTS, "variant": "luspo"}],
    "rloo": [PROMPTS],
    "ppo": [PROMPTS],
    "eval": [{"data": str(DATA / "arithmetic_eval.jsonl")}],
}


def fake_gpu_torch(monkeypatch):
    """A `torch` whose GPU has bfloat16, so kitcli.training.trl_config.device_defaults(on_gpu=True) runs here."""
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, is_bf16_supported=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", torch)


def test_planner_gpu_device_defaults_are_the_kits(monkeypatch):
    from kitcli.plan.settings import GPU_DEVICE_DEFAULTS
    from kitcli.training.trl_config import device_defaults

    fake_gpu_torch(monkeypatch)
    assert device_defaults(on_gpu=True) == GPU_DEVICE_DEFAULTS


def test_every_builtin_stage_type_has_a_sample():
    from kitcli.recipe import stage_types

    assert set(SAMPLE_STAGES) == set(stage_types.BUILTIN)


@pytest.mark.parametrize("stage_type, body", [(t, b) for t, bodies in SAMPLE_STAGES.items() for b in bodies],
                         ids=lambda v: v if isinstance(v, str) else v.get("variant", "default"))
def test_planner_defaults_follow_the_stage_defaults(in_tmp, monkeypatch, stage_type, body):
    """plan's settings are the stage's own on a GPU: COMMON_DEFAULTS < device defaults < the stage type's defaults."""
    from rich.console import Console

    from kitcli.recipe import stage_types
    from kitcli.recipe.load import load_recipe
    from kitcli.recipe.stage_context import StageContext
    from kitcli.training.trl_config import COMMON_DEFAULTS, device_defaults

    path = write_recipe(in_tmp / "r.yaml", [{"name": "s", "type": stage_type, **body}])
    recipe = load_recipe(str(path))
    stage = recipe.stage("s")
    ctx = StageContext(recipe, stage, in_tmp / "run", Console(quiet=True), {})
    spec = stage_types.spec(stage_type)
    fake_gpu_torch(monkeypatch)
    own = spec.defaults(ctx, on_gpu=True) if spec.defaults else {}
    defaults = {**COMMON_DEFAULTS, **device_defaults(on_gpu=True), **own}
    monkeypatch.setitem(sys.modules, "torch", None)  # planning itself must not import torch
    settings = plan.stage_settings(recipe, stage, "unsloth")

    if spec.evaluates:
        generation = stage_types.module(stage_type).generation_settings(ctx)
        assert settings.completion_len == generation["max_new_tokens"]
        assert settings.eval_batch_size == generation["batch_size"]
        assert settings.prompt_len == recipe.data["model"]["max_seq_length"]
        return
    assert settings.optim == defaults["optim"]
    if "gradient_checkpointing" in defaults:
        assert settings.gradient_checkpointing == defaults["gradient_checkpointing"]
    if "max_length" in defaults:
        assert settings.seq_len == defaults["max_length"]
    if stage_type == "ppo":  # one response per prompt of a rollout of per_device_train_batch_size prompts
        rollout = defaults["per_device_train_batch_size"]
        assert settings.critic and settings.num_generations == 1
        assert settings.generation_batch_size == rollout
        assert settings.per_device_train_batch_size == rollout // defaults["num_mini_batches"]
        assert settings.completion_len == defaults["response_length"]
        assert settings.beta == defaults["kl_coef"]
        return
    assert not settings.critic
    assert settings.per_device_train_batch_size == defaults["per_device_train_batch_size"]
    assert settings.gradient_accumulation_steps == defaults["gradient_accumulation_steps"]
    assert settings.beta == defaults.get("beta", 0.0)
    if stage_type == "grpo":
        grpo = stage_types.module("grpo")
        assert settings.beta == grpo.VARIANTS[body.get("variant", grpo.DEFAULT_VARIANT)]["beta"]
    if spec.rl:
        assert settings.num_generations == defaults["num_generations"]
        assert settings.completion_len == defaults["max_completion_length"]
        assert settings.steps_per_generation == defaults.get("steps_per_generation",
                                                             defaults["gradient_accumulation_steps"])


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

