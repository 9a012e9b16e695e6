"""The distill stage (kitcli/stages/distill.py): what it refuses before any model loads, what `--dry-run` and
`kit plan` say of it (the plan counts the teacher), and a short run in which the student learns from an SFT teacher
with held-out evaluation at step 0, every N steps and the last. Its loss is recomputed in
tests/test_distill_formulas.py; its resume at every kill point is in tests/test_resume.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import DATA, SFT_8_STEPS, done, metrics, run_cli, write_recipe

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")
HELD_OUT = {"data": str(DATA / "arithmetic_eval.jsonl"), "every": 4, "limit": 8, "generation": {"max_new_tokens": 4}}


def distill(**changes) -> dict:
    return {"name": "distill", "type": "distill", "teacher": {"stage": "sft"}, "data": {"path": PROMPTS, "limit": 32},
            "train": {"max_steps": 2, "max_completion_length": 4}, **changes}


def teacher_with_other_tokens(root: Path, tiny_model_dir: Path) -> str:
    """The tiny model with two token ids swapped in its tokenizer: a teacher that means other things by them."""
    folder = root / "other-tokens"
    shutil.copytree(tiny_model_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return str(folder)


BAD = {  # id -> (stages, the fragment of the one-line error)
    "teacher-names-no-stage": ([SFT_8_STEPS, distill(teacher={"stage": "sfx"})],
                               "stage 'distill': teacher.stage 'sfx' is not an earlier stage"),
    "teacher-names-a-later-stage": ([distill(), SFT_8_STEPS], "stage 'distill': teacher.stage 'sft' is not an earlier "
                                                              "stage"),
    "teacher-is-an-eval-stage": ([SFT_8_STEPS, {"name": "ev", "type": "eval", "data": HELD_OUT["data"]},
                                  distill(teacher={"stage": "ev"})],
                                 "stage 'distill': teacher.stage 'ev' is a stage of type eval"),
    "teacher-model-does-not-exist": ([distill(teacher={"model": "./no-such-model"})],
                                     "stage 'distill': teacher: model path './no-such-model' does not exist"),
    "teacher-is-a-bare-name": ([SFT_8_STEPS, distill(teacher="sft")],
                               "stage 'distill': teacher: expected {stage: NAME} (an earlier stage) or {model: "
                               "NAME_OR_PATH}, got 'sft'"),
    "teacher-has-two-sources": ([SFT_8_STEPS, distill(teacher={"stage": "sft", "model": "tiny"})],
                                "stage 'distill': teacher: give one of stage"),
    "beta-above-one": ([SFT_8_STEPS, distill(train={"beta": 1.5})], "stage 'distill': train.beta must be in [0, 1]"),
    "beta-below-zero": ([SFT_8_STEPS, distill(train={"beta": -0.1})], "stage 'distill': train.beta must be in [0, 1]"),
    "trainer-teacher-field": ([SFT_8_STEPS, distill(train={"teacher_model_name_or_path": "tiny"})],
                              "stage 'distill': train.teacher_model_name_or_path is set by the kit"),
    "teacher-on-another-type": ([{**SFT_8_STEPS, "teacher": {"stage": "x"}}], "stage 'sft': unknown key 'teacher'"),
}


@pytest.mark.parametrize("case", [*BAD, "tokenizer-differs"])
def test_bad_input_is_one_line_naming_the_stage_and_key_before_any_model_loads(tmp_path, tiny_model_dir, case):
    if case == "tokenizer-differs":
        stages = [distill(teacher={"model": teacher_with_other_tokens(tmp_path, tiny_model_dir)})]
        fragment = ("stage 'distill': teacher: its tokenizer differs from the student's (the student's token '!' is "
                    "id 3 and the teacher gives it id 4)")
    else:
        stages, fragment = BAD[case]
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", stages), "--output", tmp_path / "run", expect=2)
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("Error: ") and fragment in lines[-1], result.output
    assert "Traceback" not in result.output and "backend" not in result.output  # no model loaded
    assert not any((tmp_path / "run").glob("*/adapter"))


def test_a_teacher_stage_that_has_not_finished_stops_the_stage_before_it_loads_a_model(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.yaml", [SFT_8_STEPS, distill()])
    result = run_cli("run", recipe, "--output", tmp_path / "run", "--only", "distill", expect=2)
    assert result.output.strip().splitlines()[-1].endswith(
        f"stage 'distill': teacher.stage 'sft' has not finished in {tmp_path / 'run'}; run it too: --only "
        f"sft,distill (or --until distill)"), result.output
    assert "backend" not in result.output  # neither the student nor the teacher was loaded


def test_dry_run_describes_the_teacher_and_the_divergence(tmp_path, tiny_model_dir):
    stages = [SFT_8_STEPS, distill(train={"beta": 0.0, "temperature": 0.7, "max_completion_length": 4}, eval=HELD_OUT)]
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", stages), "--dry-run")
    text = result.output
    assert "teacher: 'stage ''sft'' (sft: its adapter on tiny), frozen'" in text, text
    assert "teacher tokenizer: the student's own (the same base model)" in text
    assert "divergence: forward KL(teacher || student) at temperature 0.7" in text
    assert "beta: 0.0" in text and "temperature: 0.7" in text and "max_completion_length: 4" in text
    assert "8 held-out rows at step 0, every 4 steps and the last" in text.replace("\n", " ")
    tokens = run_cli("run", write_recipe(tmp_path / "m.yaml", [distill(teacher={"model": str(tiny_model_dir)})]),
                     "--dry-run").output
    assert "teacher tokenizer: the same vocabulary as the student's" in tokens


def test_kit_plan_counts_the_teacher(tmp_path):
    """The teacher's weights and its forward are part of the stage's peak: the base's for an earlier stage's adapter,
    and a larger model's own (read from its config.json) for a teacher model."""
    from kitcli.plan import architecture, estimate

    larger = tmp_path / "larger"
    larger.mkdir()
    config = {**json.loads((Path(architecture.__file__).parents[1] / "assets" / "tiny" / "config.json").read_text()),
              "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8}
    (larger / "config.json").write_text(json.dumps(config))
    stages = [SFT_8_STEPS, distill(), distill(name="from-larger", teacher={"model": str(larger)})]
    plan = json.loads(run_cli("plan", write_recipe(tmp_path / "r.yaml", stages), "--json").stdout)
    by_stage = {entry["stage"]: entry for entry in plan["stages"]}

    def components(stage: str) -> dict[str, float]:
        return {c["name"].split(" (")[0]: c["gib"] for c in by_stage[stage]["components"]}

    sft, own, other = components("sft"), components("distill"), components("from-larger")
    assert "frozen model beside the policy" not in sft
    assert own["frozen model beside the policy"] == own["weights"]  # the base again, with the SFT adapter
    expected = estimate.weight_bytes(architecture.find_architecture(str(larger)), True, 4) / estimate.GiB
    assert other["frozen model beside the policy"] == pytest.approx(expected, abs=1e-3)
    assert other["frozen model beside the policy"] > 10 * other["weights"]
    assert by_stage["from-larger"]["peak_gib"] > by_stage["distill"]["peak_gib"]


@pytest.mark.slow
def test_the_student_learns_from_an_sft_teacher_and_is_evaluated_while_it_does(tmp_path, tiny_model_dir):
    """The base model, a fresh adapter, distilled from an SFT stage: the divergence it trains on falls, the teacher's
    adapter is left as it was, and `eval:` scores the student at step 0, every 4 steps and the last."""
    import torch
    from safetensors.torch import load_file

    sft = {**SFT_8_STEPS, "train": {**SFT_8_STEPS["train"], "max_steps": 40}}
    stage = distill(eval=HELD_OUT, train={"max_steps": 14, "learning_rate": 2e-3, "per_device_train_batch_size": 16,
                                          "max_completion_length": 4, "logging_steps": 1, "save_steps": 7})
    recipe = write_recipe(tmp_path / "r.yaml", [sft, stage])
    run_cli("run", recipe, "--output", tmp_path / "run", "--until", "sft")
    teacher = (tmp_path / "run" / "sft" / "adapter" / "adapter_model.safetensors").read_bytes()
    run_cli("run", recipe, "--output", tmp_path / "run")
    assert (tmp_path / "run" / "sft" / "adapter" / "adapter_model.safetensors").read_bytes() == teacher

    summary = done(tmp_path / "run" / "distill")
    assert summary["teacher"] == "stage 'sft' (sft: its adapter on tiny), frozen"
    assert summary["divergence"] == "reverse KL(student || teacher)" and summary["beta"] == 1.0
    assert summary["eval_steps"] == [0, 4, 8, 12, 14]
    losses = [row["loss"] for row in metrics(tmp_path / "run" / "distill") if "loss" in row and "entropy" in row]
    assert len(losses) == 14 and losses[0] > 1.0, losses  # the SFT teacher is far from the base at first
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses  # and the student comes closer
    student = load_file(str(tmp_path / "run" / "distill" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.count_nonzero(v) > 0 for k, v in student.items() if "lora_B" in k)  # trained from B = 0
    lock = yaml.safe_load((tmp_path / "run" / "recipe.lock.yaml").read_text())
    assert lock["recipe"]["stages"][1]["teacher"]["stage"] == "sft"  # the lock records the teacher
