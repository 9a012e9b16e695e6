"""`kit run --launcher accelerate`: the refusals, the accelerate command line, and a real 2-process CPU (gloo)
run of the tiny SFT and GRPO stages that leaves trained adapters and files written once."""

from __future__ import annotations

import textwrap

import pytest
from helpers import DATA, done, metrics, run_cli, write_recipe
from safetensors.torch import load_file

from kitcli.run import launch

SFT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
       "train": {"max_steps": 4, "per_device_train_batch_size": 8, "logging_steps": 2, "save_steps": 100,
                 "learning_rate": 2e-3}}


def test_launch_options_need_the_launcher(in_tmp):
    recipe = write_recipe(in_tmp / "r.yaml", [SFT])
    result = run_cli("run", recipe, "--num-processes", "2", "--cpu", expect=2)
    assert result.output.startswith("Error: --num-processes, --cpu only apply to multi-process runs")
    assert not (in_tmp / "runs").exists()


def test_more_processes_than_gpus_without_cpu_is_refused(in_tmp, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 1)
    recipe = write_recipe(in_tmp / "r.yaml", [SFT])
    result = run_cli("run", recipe, "--launcher", "accelerate", "--num-processes", "4", expect=2)
    assert "--num-processes 4 but 1 CUDA device is visible" in result.output and "--cpu" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    result = run_cli("run", recipe, "--launcher", "accelerate", "--num-processes", "2", expect=2)
    assert "no CUDA device is visible; add --cpu" in result.output
    assert not (in_tmp / "runs").exists()


def test_sharding_and_stage_refusals(in_tmp, monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 8)
    recipe = write_recipe(in_tmp / "r.yaml", [SFT])
    assert "needs GPUs; drop --cpu" in run_cli("run", recipe, "--launcher", "accelerate", "--num-processes", "2",
                                               "--cpu", "--fsdp", expect=2).output
    assert "exclude each other" in run_cli("run", recipe, "--launcher", "accelerate", "--num-processes", "2",
                                           "--fsdp", "--deepspeed", "zero2", expect=2).output
    four_bit = run_cli("run", recipe, "--launcher", "accelerate", "--num-processes", "2", "--fsdp", expect=2).output
    assert "model.load_in_4bit=false" in four_bit
    ppo_stage = {"name": "ppo", "type": "ppo", "data": str(DATA / "arithmetic_prompts.jsonl"),
                 "rewards": ["exact_match"]}
    ppo = write_recipe(in_tmp / "ppo.yaml", [ppo_stage])
    assert "single-process loop" in run_cli("run", ppo, "--launcher", "accelerate", "--num-processes", "2",
                                            expect=2).output
    monkeypatch.setattr(launch, "installed", lambda module: module != "deepspeed")
    assert "pip install deepspeed" in run_cli("run", recipe, "--launcher", "accelerate", "--num-processes", "2",
                                              "--deepspeed", "zero2", expect=2).output


def test_accelerate_arguments():
    plain = launch.accelerate_arguments(num_processes=2, deepspeed=None, fsdp=False, cpu=True)
    assert plain[:2] == ["--num_processes", "2"] and "--multi_gpu" in plain  # torchrun starts the 2 processes
    zero3 = launch.accelerate_arguments(num_processes=4, deepspeed="zero3", fsdp=False, cpu=False)
    assert zero3[zero3.index("--zero_stage") + 1] == "3" and "--use_deepspeed" in zero3 and "--multi_gpu" not in zero3
    fsdp = launch.accelerate_arguments(num_processes=4, deepspeed=None, fsdp=True, cpu=False)
    assert "--use_fsdp" in fsdp and fsdp[fsdp.index("--fsdp_version") + 1] == "2"
    env = launch.child_environment(2, cpu=True)
    assert env["KIT_FORCE_BACKEND"] == "transformers" and env["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.slow
def test_two_cpu_processes_train_sft_then_grpo(in_tmp, tiny_model_dir):
    """accelerate launch, 2 processes, gloo: both stages train, and the main process alone writes the files."""
    (in_tmp / "digits.py").write_text(textwrap.dedent("""
        def digits(completions, **kwargs):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [float(sum(ch.isdigit() for ch in text)) for text in texts]
    """))
    grpo = {"name": "grpo", "type": "grpo", "init": "sft", "data": str(DATA / "arithmetic_prompts.jsonl"),
            "rewards": ["digits.py:digits"],
            "train": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4,
                      "max_completion_length": 4, "temperature": 1.0, "logging_steps": 1, "save_steps": 100,
                      "learning_rate": 5e-3}}
    recipe = write_recipe(in_tmp / "r.yaml", [SFT, grpo])
    run_cli("run", recipe, "--output", in_tmp / "run", "--launcher", "accelerate", "--num-processes", "2", "--cpu")
    run = in_tmp / "run"
    assert (run / "recipe.lock.yaml").exists()
    for stage, steps in (("sft", 4), ("grpo", 2)):
        summary = done(run / stage)
        assert summary["steps"] == steps and summary["backend"] == "transformers"
        logged = [row["step"] for row in metrics(run / stage) if "loss" in row]
        assert logged == sorted(set(logged)), logged  # one line per logging step: only the main process writes
    sft = load_file(str(run / "sft" / "adapter" / "adapter_model.safetensors"))
    grpo_weights = load_file(str(run / "grpo" / "adapter" / "adapter_model.safetensors"))
    assert all(t.abs().sum() > 0 for k, t in sft.items() if "lora_B" in k)  # SFT trained (B starts at zero)
    assert sft.keys() == grpo_weights.keys()
    assert any(not (sft[k] == grpo_weights[k]).all() for k in sft)  # GRPO moved the SFT adapter
    assert done(run / "grpo")["reward_first"] is not None
    assert not list(run.glob("**/*.tmp"))
