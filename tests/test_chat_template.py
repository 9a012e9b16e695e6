"""`model.chat_template`: a name of Unsloth's get_chat_template, a Jinja string or a file, used by every stage, eval,
chat, generate and export (kitcli/models/chat_template.py). The templates here open the assistant's turn with
something other than the tiny tokenizer's own `<|im_start|>assistant\\n`, so a path that kept the tokenizer's own
template shows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner
from helpers import DATA, TINY_MODEL, fails, run_cli, write_recipe

from kitcli.commands.cli import main
from kitcli.models import chat_template

# A template of its own: `<|role|>` headers, the assistant's reply marked for assistant_only_loss.
ARROWS = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}"
          "<|im_end|>{% endgeneration %}\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ARROWS_PROMPT = "<|assistant|>"
TINY_PROMPT = "<|im_start|>assistant\n"  # the tiny tokenizer's own generation prompt
ZEPHYR_PROMPT = "<|assistant|>\n"  # Unsloth's `zephyr`
ONE_TURN = [{"role": "user", "content": "What is 2+3?"}]
HELD_OUT = {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 2}


def sft_stage(**train) -> dict:
    return {"name": "sft", "type": "sft", "data": {"path": str(DATA / "arithmetic_sft.jsonl"), "limit": 32},
            "train": {"max_steps": 2, "learning_rate": 1e-3, "per_device_train_batch_size": 8, "logging_steps": 1,
                      "save_steps": 100, **train}}


def generation_prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(ONE_TURN, tokenize=False, add_generation_prompt=True)


# --- Unsloth's names, read without importing it ------------------------------------------------------------------

def test_unsloth_names_and_templates_are_read_from_its_source_as_get_chat_template_sets_them(tiny_model_dir):
    from transformers import AutoTokenizer
    from unsloth.chat_templates import CHAT_TEMPLATES, get_chat_template

    read = chat_template.unsloth_templates()
    assert set(read) == set(CHAT_TEMPLATES)
    compared = 0
    for name in sorted(read):
        try:  # a template that renames tokens the tiny vocabulary lacks (Gemma's) cannot go on this tokenizer
            applied = get_chat_template(AutoTokenizer.from_pretrained(str(tiny_model_dir)), chat_template=name)
        except RuntimeError:
            continue
        assert read[name] == applied.chat_template, name
        compared += 1
    assert compared >= 40


def test_a_recipe_with_a_chat_template_is_checked_without_importing_unsloth_or_transformers(tmp_path):
    (tmp_path / "arrows.jinja").write_text(ARROWS)
    recipes = [write_recipe(tmp_path / f"{i}.yaml", [sft_stage()], model={**TINY_MODEL, "chat_template": value})
               for i, value in enumerate(["zephyr", ARROWS, "arrows.jinja"])]
    code = ("import sys; from kitcli.recipe.load import load_recipe; "
            f"print([load_recipe(p).model.chat_template for p in {[str(r) for r in recipes]}]); "
            "print([m for m in ('unsloth', 'transformers', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    values, imported = out.splitlines()
    assert values == str(["zephyr", ARROWS, str(tmp_path / "arrows.jinja")])  # the file: beside the recipe, absolute
    assert imported == "[]"


# --- bad input: one line, exit 2, before anything loads ----------------------------------------------------------

BAD_TEMPLATES = {
    "zephry": "'zephry' is not a name Unsloth's get_chat_template knows, a Jinja string (with {% ... %} or {{ ... }}) "
              "or an existing file; did you mean 'zephyr'?",
    "templates/chat.jinja": "template file 'templates/chat.jinja' does not exist (looked relative to {folder})",
    "{% for m in messages %}{{ m['content'] }}": "the template does not parse as Jinja (line 1: Unexpected end of "
                                                 "template",
    "{{ raise_exception('Conversation roles must alternate') }}": "the template cannot render a one-turn "
                                                                 "conversation with a generation prompt "
                                                                 "(TemplateError: Conversation roles must alternate)",
    "{% for m in messages %}{{ m['text'] }}{% endfor %}": "the template renders a one-turn conversation without the "
                                                          "turn's text (got ''); does it read message['content']?",
    "broken.jinja": "file 'broken.jinja' does not parse as Jinja (line 2:",
    "empty.jinja": "file 'empty.jinja' is empty",
}


@pytest.mark.parametrize("value", list(BAD_TEMPLATES))
def test_a_bad_chat_template_is_one_line_naming_the_key_before_anything_loads(tmp_path, value):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    (tmp_path / "empty.jinja").write_text("\n")
    recipe = write_recipe(tmp_path / "recipe.yaml", [sft_stage()], model={**TINY_MODEL, "chat_template": value})
    line = fails("run", recipe, "--output", tmp_path / "run")
    expected = BAD_TEMPLATES[value].replace("{folder}", str(tmp_path))
    assert line.startswith(f"Error: {recipe}: model.chat_template: {expected}")
    assert not (tmp_path / "run").exists()  # nothing ran, not even the run directory was made


def test_a_named_template_with_the_transformers_backend_is_refused_with_what_to_give(tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", [sft_stage()],
                          model={**TINY_MODEL, "backend": "transformers", "chat_template": "chatml"})
    assert fails("check", recipe) == (
        f"Error: {recipe}: model.chat_template: 'chatml' is one of Unsloth's get_chat_template names, and "
        f"model.backend: transformers loads no Unsloth; give the template's Jinja text (or a file holding it) instead")


def test_the_checking_environment_renders_as_transformers_does(tiny_model_dir):
    """The recipe's check renders in its own copy of transformers' Jinja environment (no transformers import):
    the tiny template ({% generation %}, tojson, tools) and Unsloth's templates render to the same text in both."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tools = [{"type": "function", "function": {"name": "add", "description": "adds",
                                               "parameters": {"properties": {"a": {"type": "integer"}}}}}]
    conversation = [*ONE_TURN, {"role": "assistant", "content": "",
                                "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}]}]
    for template in [tokenizer.chat_template, ARROWS, *chat_template.unsloth_templates().values()]:
        for messages, extra in ((ONE_TURN, {}), (conversation, {"tools": tools})):
            try:
                expected = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                         add_generation_prompt=True, **extra)
            except Exception:  # noqa: BLE001  (a template that refuses tool calls refuses them in both)
                continue
            ours = chat_template.jinja_environment().from_string(template).render(
                messages=messages, add_generation_prompt=True, **tokenizer.special_tokens_map, **extra)
            assert ours == expected


# --- the loaders: the policy's and the reward model's tokenizer ----------------------------------------------------

def test_the_policy_and_reward_model_tokenizers_get_a_named_template():
    from kitcli.models.backend import load_policy
    from kitcli.models.reward_models import load_reward_model

    settings = {"max_seq_length": 128, "load_in_4bit": False, "dtype": "float32", "log": lambda message: None}
    own = load_policy("tiny", lora=None, trainable=False, **settings)
    assert generation_prompt(own.tokenizer).endswith(TINY_PROMPT)
    policy = load_policy("tiny", lora=None, trainable=False, chat_template="zephyr", **settings)
    assert generation_prompt(policy.tokenizer) == "<|user|>\nWhat is 2+3?<|im_end|>\n" + ZEPHYR_PROMPT
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]}
    reward = load_reward_model("tiny", lora=lora, chat_template=ARROWS, **settings)
    assert generation_prompt(reward.tokenizer) == "<|user|>What is 2+3?\n" + ARROWS_PROMPT


# --- a run: training rows, eval, generate, chat, the saved adapter, exports ----------------------------------------

@pytest.fixture(scope="module")
def templated_run(tmp_path_factory, tiny_model_dir):
    """eval (base) -> a 2-step SFT -> eval (sft) with ARROWS, from a file beside the recipe; the SFT trainer and
    every prompt a model was asked to continue (GenerationMixin.generate's inputs, decoded) are kept."""
    from transformers import AutoTokenizer
    from transformers.generation.utils import GenerationMixin

    from kitcli.stages import sft

    root = tmp_path_factory.mktemp("templated")
    (root / "chat.jinja").write_text(ARROWS)
    stages = [{"name": "eval-before", "type": "eval", "data": HELD_OUT, "generation": {"max_new_tokens": 2}},
              sft_stage(assistant_only_loss=True),
              {"name": "eval-after", "type": "eval", "init": "sft", "data": HELD_OUT,
               "generation": {"max_new_tokens": 2}}]
    recipe = write_recipe(root / "recipe.yaml", stages, model={**TINY_MODEL, "chat_template": "chat.jinja"})
    decode = AutoTokenizer.from_pretrained(str(tiny_model_dir)).decode
    seen = {"trainers": [], "prompts": []}
    build_trainer, generate = sft.build_trainer, GenerationMixin.generate

    def keep_trainer(*args, **kwargs):
        trainer = build_trainer(*args, **kwargs)
        seen["trainers"].append(trainer[0])
        return trainer

    def keep_prompts(self, *args, **kwargs):
        seen["prompts"] += [decode(ids[mask.bool()]) for ids, mask in zip(kwargs["input_ids"],
                                                                          kwargs["attention_mask"])]
        return generate(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sft, "build_trainer", keep_trainer)
        patch.setattr(GenerationMixin, "generate", keep_prompts)
        run_cli("run", recipe, "--output", root / "run")
        seen["run_prompts"], seen["prompts"] = seen["prompts"], []
        prompts = root / "prompts.jsonl"
        prompts.write_text(json.dumps({"prompt": ONE_TURN, "answer": "5"}) + "\n")
        run_cli("generate", root / "run", "--prompts", prompts, "--max-new-tokens", "2")
        run_cli("eval", root / "run" / "sft", "--data", prompts, "--max-new-tokens", "2", "--output", root / "eval")
        chat = CliRunner().invoke(main, ["chat", str(root / "run" / "sft"), "--max-new-tokens", "2"],
                                  input="What is 2+3?\n/exit\n")
        assert chat.exit_code == 0, (chat.output, chat.exception)
    seen["run"] = root / "run"
    return seen


@pytest.mark.slow
def test_sft_trains_on_rows_rendered_with_the_recipes_template(templated_run):
    (trainer,) = templated_run["trainers"]
    decode = trainer.processing_class.decode
    row = trainer.train_dataset[0]  # {"prompt": [user: Jun has 2 books ...], "completion": [assistant: 7]}
    # assistant_only_loss: TRL trains the tokens the template marks with {% generation %} (labels != -100)
    prompt = [t for t, label in zip(row["input_ids"], row["labels"]) if label == -100]
    trained = [t for t in row["labels"] if t != -100]
    assert decode(prompt) == "<|user|>Jun has 2 books and gets 5 more. How many books does Jun have?\n" + ARROWS_PROMPT
    assert decode(trained) == "7<|im_end|>"


@pytest.mark.slow
def test_eval_generate_and_chat_prompt_the_model_with_the_templates_generation_prompt(templated_run):
    run_prompts = templated_run["run_prompts"]
    assert len(run_prompts) == 4  # eval-before and eval-after, 2 prompts each
    assert all(p.startswith("<|user|>") and p.endswith(f"\n{ARROWS_PROMPT}") for p in run_prompts), run_prompts
    generate_prompt, eval_prompt, chat_prompt = templated_run["prompts"]  # kit generate, kit eval, kit chat
    assert generate_prompt == eval_prompt == chat_prompt == "<|user|>What is 2+3?\n" + ARROWS_PROMPT


@pytest.mark.slow
def test_the_saved_adapter_the_lock_and_the_exports_carry_the_template(templated_run, tmp_path):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    run = templated_run["run"]
    assert AutoTokenizer.from_pretrained(str(run / "sft" / "adapter")).chat_template == ARROWS
    lock = yaml.safe_load((run / "recipe.lock.yaml").read_text())
    assert lock["recipe"]["model"]["chat_template"] == str(run.parent / "chat.jinja")
    run_cli("export", run, "--to", "lora", "--output", tmp_path / "lora")
    assert AutoTokenizer.from_pretrained(str(tmp_path / "lora")).chat_template == ARROWS
    run_cli("export", run, "--to", "gguf", "--quant", "f32", "--output", tmp_path / "gguf")
    field = GGUFReader(str(tmp_path / "gguf" / "sft.F32.gguf")).fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == ARROWS


def test_a_process_without_unsloth_refuses_a_named_template_before_the_model_loads():
    """`kit run --launcher` runs its processes with KIT_FORCE_BACKEND=transformers: Unsloth is never imported there,
    so its get_chat_template cannot apply a named template; the loader says so before it loads anything."""
    import os

    code = ("import sys\nfrom kitcli.errors import KitError\nfrom kitcli.models.backend import load_policy\n"
            "try:\n    load_policy('tiny', max_seq_length=64, load_in_4bit=False, lora=None, chat_template='zephyr')\n"
            "except KitError as error:\n    print(error.message)\n"
            "print([m for m in ('unsloth', 'transformers.models.qwen2.modeling_qwen2') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "KIT_FORCE_BACKEND": "transformers"})
    message, imported = result.stdout.splitlines()[-2:]
    assert message == ("policy: model.chat_template 'zephyr' is applied by Unsloth's get_chat_template, and this "
                       "process loads models without Unsloth (the transformers backend); give the template's Jinja "
                       "text (or a file holding it) instead")
    assert imported == "[]"  # no model class was even imported


def test_assistant_only_loss_is_checked_against_the_recipes_template_before_anything_loads(tmp_path):
    """The tiny tokenizer's own template marks the assistant's turns; Unsloth's `zephyr` does not, and TRL has no
    training variant of it: refused by the dry run, as it would be by TRL once the model had loaded."""
    recipe = write_recipe(tmp_path / "recipe.yaml", [sft_stage(assistant_only_loss=True)],
                          model={**TINY_MODEL, "chat_template": "zephyr"})
    line = fails("run", recipe, "--dry-run")
    assert "train.assistant_only_loss: the chat template of 'tiny' marks no assistant tokens" in line
    run_cli("run", write_recipe(tmp_path / "own.yaml", [sft_stage(assistant_only_loss=True)]), "--dry-run")
