"""`kit export`: adapter copy, a merged model that generates what the adapter model generates, GGUF's clear
error without llama.cpp, the model card, and the refusals (no finished stage, a non-empty output)."""

from __future__ import annotations

import json

import torch
from helpers import run_cli, snapshot

from kitcli.evaluate import generate

PROMPTS = [[{"role": "user", "content": "Ada has 3 apples and gets 5 more. How many apples does Ada have?"}],
           [{"role": "user", "content": "Bo has 7 cups and gets 2 more. How many cups does Bo have?"}],
           [{"role": "user", "content": "Cy has 4 pens and gets 4 more. How many pens does Cy have?"}],
           "2+2="]


def test_lora_export_is_the_adapter_with_tokenizer_and_card(trained_run, tmp_path):
    out = tmp_path / "lora"
    result = run_cli("export", trained_run, "--to", "lora", "--output", out)
    assert f"to {out}" in result.output
    adapter = trained_run / "sft" / "adapter"
    assert (out / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    assert (out / "tokenizer.json").exists()
    assert "<|im_start|>" in chat_template(out)
    card = (out / "README.md").read_text()
    assert card.startswith("# export-test: stage `sft` (PEFT LoRA adapter)")
    assert "| sft | sft | base | done | loss" in card
    assert "## Evaluation (held-out)" in card and "| eval-before | base |" in card and "| eval-after | sft |" in card
    assert "PeftModel.from_pretrained" in card
    assert not (out.parent / "lora.tmp").exists()


def chat_template(folder) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).chat_template or ""


def test_merged_export_generates_what_the_adapter_model_generates(trained_run, tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    run_cli("export", f"{trained_run}/sft", "--to", "merged", "--dtype", "float32", "--output", out)
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(out))  # plain transformers, no PEFT
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert "<|im_start|>" in (tokenizer.chat_template or "")
    assert "(merged float32 transformers checkpoint" in (out / "README.md").read_text()

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(trained_run / "sft" / "adapter"))
    expected = generate(adapted, tokenizer, PROMPTS, max_new_tokens=6)
    assert generate(merged, tokenizer, PROMPTS, max_new_tokens=6) == expected
    untrained = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert generate(untrained, tokenizer, PROMPTS, max_new_tokens=6) != expected  # the adapter did something


def test_merged_export_is_16_bit_by_default(trained_run):
    from safetensors.torch import load_file

    run_cli("export", trained_run, "--to", "merged")
    out = trained_run / "exports" / "sft-merged"
    weights = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_gguf_without_llama_cpp_says_what_to_install(trained_run, tmp_path, monkeypatch):
    monkeypatch.setenv("UNSLOTH_LLAMA_CPP_PATH", str(tmp_path / "no-llama.cpp"))
    before = snapshot(trained_run)
    result = run_cli("export", trained_run, "--to", "gguf", "--quant", "q8_0", "--output", tmp_path / "gguf", expect=2)
    assert result.output.startswith("Error: GGUF export needs llama.cpp")
    assert "convert_hf_to_gguf.py and llama-quantize" in result.output and "git clone" in result.output
    assert "`kit export --to merged` works without it" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "gguf").exists() and snapshot(trained_run) == before


def test_export_refuses_a_non_empty_directory_without_force(trained_run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = run_cli("export", trained_run, "--to", "lora", "--output", out, expect=2)
    assert "exists and is not empty" in result.output and "--force" in result.output
    assert (out / "notes.txt").read_text() == "mine"
    run_cli("export", trained_run, "--to", "lora", "--output", out, "--force")
    assert not (out / "notes.txt").exists() and (out / "adapter_model.safetensors").exists()


def test_export_needs_a_finished_policy_stage(trained_run, tmp_path):
    import shutil

    copy = tmp_path / "unfinished"
    shutil.copytree(trained_run, copy, ignore=shutil.ignore_patterns("exports", "checkpoints", "*.safetensors"))
    (copy / "sft" / "DONE").unlink()
    result = run_cli("export", copy, "--to", "lora", expect=2)
    assert "no finished stage that saved a policy" in result.output
    assert "is an eval stage" in run_cli("export", copy / "eval-after", "--to", "lora", expect=2).output
    assert "--quant applies to --to gguf only" in run_cli("export", trained_run, "--to", "lora", "--quant", "f16",
                                                          expect=2).output


def test_the_report_redraws_only_the_plots_whose_stage_changed(trained_run, tmp_path):
    """(Beside the export tests because it reads the same trained run.) `kit run` writes the report at the end of
    every invocation; a plot newer than its stage's files is kept, one whose stage logged again is redrawn."""
    import shutil
    import time

    from kitcli.report import write_report

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    write_report(run)

    def drawn() -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in (run / "plots").glob("*.png")}

    before = drawn()
    assert {"sft.png", "eval.png"} <= before.keys()
    time.sleep(0.02)
    write_report(run)
    assert drawn() == before
    with open(run / "sft" / "metrics.jsonl", "a") as f:  # the stage logged again (as a resumed stage does)
        f.write('{"step": 13, "loss": 1.0}\n')
    write_report(run)
    after = drawn()
    assert after["sft.png"] > before["sft.png"] and after["eval.png"] == before["eval.png"]
    report = (run / "report.md").read_text()
    assert "![sft training curves](plots/sft.png)" in report and "![held-out evaluation](plots/eval.png)" in report
