"""`kit export`: adapter copy, a merged model that generates what the adapter model generates, a GGUF file that
loads again as a recipe's model (and k-quants' clear error without llama.cpp), the model card, and the refusals
(no finished stage, a non-empty output)."""

from __future__ import annotations

import json

import torch
from helpers import DATA, run_cli, snapshot, write_recipe

from kitcli.cache import file_sha256
from kitcli.models.generate import generate

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


def test_gguf_export_needs_no_llama_cpp_and_loads_again_as_a_model(trained_run, tmp_path, monkeypatch):
    """The round trip a user makes: export the trained stage as GGUF (written by the kit, llama.cpp absent), then
    start a recipe from that file. Its evaluation completes every held-out prompt exactly as the exported stage's
    own evaluation did (f32: nothing rounded), and q8_0, the default, is the same model at a quarter of the size."""
    monkeypatch.setenv("UNSLOTH_LLAMA_CPP_PATH", str(tmp_path / "no-llama.cpp"))
    out = tmp_path / "gguf"
    run_cli("export", trained_run, "--to", "gguf", "--quant", "f32", "--output", out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "sft.F32.gguf"]  # the tokenizer is in the file
    assert "model: path/to/sft.F32.gguf" in (out / "README.md").read_text()
    run_cli("export", trained_run, "--to", "gguf")
    default = trained_run / "exports" / "sft-gguf-q8_0" / "sft.Q8_0.gguf"
    assert default.stat().st_size < (out / "sft.F32.gguf").stat().st_size / 3

    expected = [json.loads(line) for line in (trained_run / "eval-after" / "samples.jsonl").read_text().splitlines()]
    before = [json.loads(line) for line in (trained_run / "eval-before" / "samples.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in expected] != [r["completion"] for r in before]  # the stage changed the model
    stages = [{"name": "eval", "type": "eval", "data": {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 4},
               "generation": {"max_new_tokens": 4}}]
    recipe = write_recipe(tmp_path / "from-gguf.yaml", stages, name="from-gguf", model=str(out / "sft.F32.gguf"))
    run_cli("run", recipe, "--output", tmp_path / "run")
    again = [json.loads(line) for line in (tmp_path / "run" / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in again] == [r["completion"] for r in expected]
    lock = (tmp_path / "run" / "recipe.lock.yaml").read_text()
    assert file_sha256(out / "sft.F32.gguf") in lock


def test_gguf_k_quants_without_llama_cpp_say_what_to_install(trained_run, tmp_path, monkeypatch):
    monkeypatch.setenv("UNSLOTH_LLAMA_CPP_PATH", str(tmp_path / "no-llama.cpp"))
    before = snapshot(trained_run)
    result = run_cli("export", trained_run, "--to", "gguf", "--quant", "q4_k_m", "--output", tmp_path / "gguf",
                     expect=2)
    assert result.output.startswith("Error: this GGUF export needs llama.cpp (--quant q4_k_m (a k-quant) is made by "
                                    "llama-quantize)")
    assert "convert_hf_to_gguf.py and llama-quantize" in result.output and "git clone" in result.output
    assert "--quant q8_0 or f16 of a LLaMA/Qwen model, and --to merged, work without it" in result.output
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

    from kitcli.display.report import write_report

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    write_report(run)

    def drawn() -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in (run / "plots").glob("*.svg")}

    before = drawn()
    assert {"sft.svg", "eval.svg"} <= before.keys()
    time.sleep(0.02)
    write_report(run)
    assert drawn() == before
    with open(run / "sft" / "metrics.jsonl", "a") as f:  # the stage logged again (as a resumed stage does)
        f.write('{"step": 13, "loss": 1.0}\n')
    write_report(run)
    after = drawn()
    assert after["sft.svg"] > before["sft.svg"] and after["eval.svg"] == before["eval.svg"]
    report = (run / "report.md").read_text()
    assert "![sft training curves](plots/sft.svg)" in report and "![held-out evaluation](plots/eval.svg)" in report
