"""`kit doctor`: every check reported with a status and a fix; the exit status follows the critical checks."""

from __future__ import annotations

import json

from helpers import run_cli

from kitcli.commands import doctor

EXPECTED = {"python", "torch", "cuda devices", "bf16", "bitsandbytes 4-bit", "unsloth backend", "vllm", "trl",
            "transformers", "peft", "unsloth", "datasets", "hub offline mode"}


def test_doctor_json_reports_every_check_and_passes_here():
    result = run_cli("doctor", "--json")
    report = json.loads(result.stdout)
    names = {c["name"] for c in report["checks"]}
    assert names >= EXPECTED
    assert any(name.startswith("disk: ") for name in names)
    assert report["ok"] is True
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["python"]["status"] == "ok" and by_name["python"]["critical"]
    assert by_name["bitsandbytes 4-bit"]["status"] == "ok"  # a real NF4 quantize + matmul on this device
    assert "relative error" in by_name["bitsandbytes 4-bit"]["detail"]
    assert by_name["trl"]["detail"].startswith(doctor.known_good()["trl"])
    assert by_name["hub offline mode"]["detail"].startswith("HF_HUB_OFFLINE")  # tests run offline
    for check in report["checks"]:
        assert check["status"] in ("ok", "warn", "fail")
        assert check["status"] == "ok" or check["fix"] or check["name"] == "bf16", check


def test_doctor_says_what_gguf_export_can_write(monkeypatch, tmp_path):
    monkeypatch.setenv("UNSLOTH_LLAMA_CPP_PATH", str(tmp_path / "none"))
    by_name = {c["name"]: c for c in json.loads(run_cli("doctor", "--json").stdout)["checks"]}
    assert by_name["gguf export"]["status"] == "ok" and "q8_0" in by_name["gguf export"]["detail"]
    assert by_name["llama.cpp"]["status"] == "warn" and "k-quants" in by_name["llama.cpp"]["detail"]
    llama_cpp = tmp_path / "llama.cpp"
    llama_cpp.mkdir()
    (llama_cpp / "convert_hf_to_gguf.py").write_text("")
    (llama_cpp / "llama-quantize").write_text("")
    (llama_cpp / "llama-quantize").chmod(0o755)
    monkeypatch.setenv("UNSLOTH_LLAMA_CPP_PATH", str(llama_cpp))
    by_name = {c["name"]: c for c in json.loads(run_cli("doctor", "--json").stdout)["checks"]}
    assert by_name["llama.cpp"]["status"] == "ok" and by_name["llama.cpp"]["detail"].startswith(str(llama_cpp))


def test_doctor_table_says_ready():
    result = run_cli("doctor")
    assert "kit doctor" in result.output and "ready: every critical check passed" in result.output


def test_a_failed_critical_check_gives_exit_status_1(monkeypatch):
    monkeypatch.setitem(doctor.CORE, "kit_missing_library", "kit-missing-library")
    result = run_cli("doctor", "--json", expect=1)
    report = json.loads(result.stdout)
    missing = next(c for c in report["checks"] if c["name"] == "kit_missing_library")
    assert report["ok"] is False
    assert missing["status"] == "fail" and missing["fix"] == "pip install kit-missing-library"
    table = run_cli("doctor", expect=1)
    assert "not ready: kit_missing_library failed" in table.output


def test_version_mismatch_is_a_warning_with_the_pin(monkeypatch):
    monkeypatch.setattr(doctor, "known_good", lambda: {"trl": "0.0.1"})
    checks = {c.name: c for c in doctor.check_versions()}
    assert checks["trl"].status == "warn" and checks["trl"].fix == "pip install trl==0.0.1"
    assert not checks["trl"].critical


def test_doctor_says_whether_this_cpu_has_native_bf16_and_what_it_changes(unsloth_cpu_bf16):
    """Unsloth's CPU backend decides bf16 by the CPU (AMX-BF16 / AVX512-BF16) or UNSLOTH_CPU_BF16; the doctor reports
    its answer and that the kit's CPU settings do not depend on it (float32 either way)."""
    import torch

    if torch.cuda.is_available():
        return  # a GPU machine reports the GPU's bf16 instead (check_torch)
    by_name = {c["name"]: c for c in json.loads(run_cli("doctor", "--json").stdout)["checks"]}
    detail = by_name["cpu bf16"]["detail"]
    assert detail.startswith("native bf16" if unsloth_cpu_bf16 else "no native bf16"), detail
    assert "UNSLOTH_CPU_BF16=" in detail and "float32 on a CPU either way" in detail
    assert ("runs at full speed" if unsloth_cpu_bf16 else "would be emulated") in detail
