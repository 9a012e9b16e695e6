"""The embedded tiny model: a small Qwen2 causal LM and a byte-level tokenizer with a ChatML template.

The model ships with the kit (kitcli/assets/tiny/, 2.5 MB): `model: tiny` copies it once to
`$KIT_HOME/models/tiny-<sha>` and loads it through the same `load_policy` path as any local model directory. It is
the same file on every machine, so a figure measured with it is one a fresh clone can reproduce.

It was built by this module's own recipe (`python -m kitcli.tiny build`: a config, a BPE tokenizer trained on a
fixed corpus, 300 steps of full-parameter pretraining on sums). The tokenizer build is deterministic anywhere; the
pretraining is deterministic on one machine but not across CPUs (float reductions differ between vector units),
which is why the result is shipped instead of built at first use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from kitcli.cache import file_sha256, kit_home

TINY_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
TOKENIZER_VOCAB_SIZE = 320
PRETRAIN_STEPS = 300
PRETRAIN_BATCH = 32
PRETRAIN_FACTS_PER_DOC = 4
PRETRAIN_LR = 3e-3
BUILD_VERSION = 2  # bump when the recipe for building the tiny model changes

# ChatML. A conversation without tools renders exactly as the template before tools did (tests/test_tools.py
# compares): only a `tools=` list (a system turn after the conversation's own system message, one line per function
# from its JSON schema: `name(param: type, ...): description param: its description`) and assistant turns with
# `tool_calls` (Qwen's `<tool_call>` JSON blocks) add anything. Tool results are `tool` turns like any other role.
# Every turn renders on its own, so the template keeps prefixes (TRL's multi-turn GRPO needs that). The schema is
# written as a line, not as JSON, because the tiny tokenizer spends a token on nearly every JSON character and the
# model has 512 positions: the calculator's JSON schema alone took about 370 of them, its line takes far fewer.
# An assistant turn's reply (after its header, up to its <|im_end|>) is marked with {% generation %}, which renders
# nothing: with train.assistant_only_loss, TRL's SFT trains those tokens only, so a tool's result carries no loss.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ 'Tools: call one as <tool_call>\n{\"name\": NAME, \"arguments\": {...}}\n</tool_call>\n' }}"
    "{% for tool in tools %}{% set function = tool['function'] if tool['function'] is defined else tool %}"
    "{% set parameters = function['parameters']['properties'] if function['parameters'] is defined else {} %}"
    "{{ function['name'] + '(' }}{% for name, spec in parameters.items() %}"
    "{{ (', ' if not loop.first else '') + name + ': ' + (spec['type'] if spec['type'] is string"
    " else spec['type'] | join('|')) }}{% endfor %}"
    "{{ '): ' + (function['description'] if function['description'] is defined else '') }}"
    "{% for name, spec in parameters.items() %}{% if spec['description'] is defined %}"
    "{{ ' ' + name + ': ' + spec['description'] }}{% endif %}{% endfor %}{{ '\n' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ ('\n' if message['content'] or not loop.first else '') + '<tool_call>\n{\"name\": \"' + function['name']"
    " + '\", \"arguments\": ' + (function['arguments'] if function['arguments'] is string"
    " else function['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The template before tools: tests check that plain conversations still render byte for byte as with it.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# How a reply is parsed back into content and tool calls (transformers' `parse_response`): TRL's own response
# template for Qwen3 (trl/chat_template_utils.py `qwen3_template`), whose markers the tiny template shares. TRL knows
# a template by its exact text, which the tiny one is not, or by the tokenizer's `response_template`: the kit sets
# this one on the tiny tokenizer in a stage with tools (kitcli/training/tool_use.py), and only there, because TRL
# parses every chat completion with a tokenizer's response template once it has one (stripping whitespace and
# <think> blocks), and the rewards of a stage without tools see the decoded text as before.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


ASSETS = Path(__file__).resolve().parents[1] / "assets" / "tiny"
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja")
# sha256 of the shipped model.safetensors: what every machine trains from (tests/test_backend.py checks it)
TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja")
TINY_SHA256 = "2acf97ce1131a1b137520b62d3aee2b07cfaa95153728bbcda3e028c53b738ab"


def tiny_model_dir(seed: int = 0) -> Path:
    """Where the shipped tiny model is copied (`seed` is kept for callers; the shipped model is seed 0's): named by
    its weights and its tokenizer files, so a copy made before the chat template changed is not reused."""
    digest = hashlib.sha256("".join(file_sha256(ASSETS / name) for name in TOKENIZER_FILES
                                    if (ASSETS / name).is_file()).encode()).hexdigest()
    return kit_home() / "models" / f"tiny-{TINY_SHA256[:12]}-{digest[:8]}"


def ensure_tiny_model(seed: int = 0) -> Path:
    """Return the directory of the tiny model, copying the shipped one there on first use."""
    target = tiny_model_dir(seed)
    if all((target / name).exists() for name in SHIPPED_FILES):
        return target
    missing = [name for name in SHIPPED_FILES if not (ASSETS / name).is_file()]
    if missing:
        from kitcli.errors import KitError

        raise KitError(f"the kit's tiny model is incomplete ({ASSETS} has no {', '.join(missing)}); reinstall the kit "
                       f"(pip install -e .), or rebuild it with `python -m kitcli.tiny build`")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(ASSETS, staging, ignore=shutil.ignore_patterns("*.md"))
    try:
        staging.rename(target)  # atomic: a concurrent copier that lost the race just uses the winner's copy
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_model(target: Path, seed: int = 0) -> Path:
    """Build the tiny model from its recipe into `target` (what `python -m kitcli.tiny build` runs)."""
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), tokenizer, seed)
    pretrain(model, tokenizer, seed)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def pretraining_text(rng) -> str:
    """One pretraining document: plain-text single-digit sums and a word problem, no chat template.

    The base model learns its arithmetic "knowledge" here; fine-tuning later teaches it to answer questions
    in the chat format.
    """
    from kitcli.data.synthetic import word_problem

    parts = []
    for _ in range(PRETRAIN_FACTS_PER_DOC):
        a, b = rng.randrange(10), rng.randrange(10)
        parts.append(f"{a}+{b}={a + b}")
    problem = word_problem(rng.randrange(10), rng.randrange(10), rng)
    parts.append(f"Q: {problem['question']} A: {problem['answer']}")
    return " ".join(parts) + "\n"


def pretrain(model, tokenizer, seed: int) -> None:
    """A short full-parameter pretraining run so the base is a language model, not noise.

    LoRA on a randomly initialised network barely learns (its frozen random projections and tied
    embeddings leave a low-rank update little to work with); a real LoRA run starts from a trained base.
    """
    import random

    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=PRETRAIN_LR, total_steps=PRETRAIN_STEPS,
                                                   pct_start=0.1)
    model.train()
    for _ in range(PRETRAIN_STEPS):
        # Each document ends with the end-of-sequence token, as in real pretraining; without it the token's
        # (tied) embedding stays random and a fine-tuned model cannot learn to stop after its answer.
        docs = [pretraining_text(rng).rstrip("\n") + tokenizer.eos_token for _ in range(PRETRAIN_BATCH)]
        batch = tokenizer(docs, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def tokenizer_corpus() -> list[str]:
    """Text the byte-level BPE is trained on; digits are split off, so numbers are always per-digit tokens."""
    import random

    from kitcli.data import synthetic

    rng = random.Random(0)
    # the template before tools: the shipped vocabulary was trained on it, and a rebuild must give the same one
    lines = [PLAIN_CHAT_TEMPLATE, "<think> </think> <answer> </answer> Answer: The answer is"]
    pairs = [(a, b) for a in range(10) for b in range(10)]
    lines += [p["question"] for p in synthetic.word_problems(pairs, 500, seed=0)]
    lines += [pretraining_text(rng) for _ in range(200)]
    return lines


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        padding_side="right",
    )


def build_model(vocab_size: int, tokenizer, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
        **TINY_CONFIG,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def main(argv: list[str] | None = None) -> None:
    """`python -m kitcli.tiny build [DIR]`: rebuild the tiny model (default: over the shipped one) and print its
    sha256; on another CPU the pretrained weights differ in their last bits, so commit a rebuild with TINY_SHA256."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kitcli.tiny", description="The kit's embedded tiny model.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    build = commands.add_parser("build", help="rebuild it from its recipe and print its sha256",
                                description="Rebuild the tiny model from its recipe (config, tokenizer, 300 steps "
                                            "of pretraining) and print model.safetensors' sha256.")
    build.add_argument("dir", nargs="?", type=Path, default=ASSETS, metavar="DIR",
                       help="where to write it (default: over the shipped kitcli/assets/tiny/)")
    target = parser.parse_args(argv).dir
    build_tiny_model(target)
    print(f"built {target}: model.safetensors sha256 {file_sha256(target / 'model.safetensors')}")


if __name__ == "__main__":
    main()
