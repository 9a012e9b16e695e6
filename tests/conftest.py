"""Test setup: one shared KIT_HOME (the tiny model is built once per checkout), unsloth imported first."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("KIT_HOME", str(ROOT / ".pytest_kit_home"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Unsloth compiles its generated trainers into this folder: one per xdist worker, so two workers forcing Unsloth's
# trainers at once never write the same files.
os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", str(Path(os.environ["KIT_HOME"]) / "unsloth_compiled_cache"
                                                      / os.environ.get("PYTEST_XDIST_WORKER", "main")))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers on a 2-core machine: one torch thread each (and in the `kit run`
    # subprocesses they start), or OpenMP threads of the two workers fight for the cores and both run far slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    """Import unsloth before any test module imports trl / transformers / peft, as in a real run; not in the
    pytest-xdist controller, which runs no test (the import costs 7 s there, before any worker starts)."""
    controller = bool(getattr(config.option, "numprocesses", None)) and not os.environ.get("PYTEST_XDIST_WORKER")
    if not controller and importlib.util.find_spec("unsloth") is not None:
        import unsloth  # noqa: F401


FAMILIES = ("trl", "unsloth")


def uses_unsloth_trainers(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("trainer_family") == "unsloth"


# Fixtures that train the tiny model: a test that uses one is slow, like a test that trains itself.
TRAINING_FIXTURES = {"trained", "run", "ppo_run", "trained_run", "uninterrupted", "sft_run", "sft_rm_run",
                     "sft_dpo_run", "interrupted", "sft_kto_rloo_run", "trained_run_dir"}


def xdist_group(item) -> str:
    """The unit of work a pytest-xdist worker takes whole (`make test` runs `--dist loadgroup`): a test file, so its
    module fixtures are built once; a file's tests per stage type where they are parametrized by it (the resume
    tests, the longest file); and a file's tests on Unsloth's forced trainers, after every other group (groups go
    out in collection order, so a worker never runs a TRL test after an Unsloth one), shared by both workers."""
    if uses_unsloth_trainers(item):
        return f"unsloth-{item.path.name}"
    callspec = getattr(item, "callspec", None)
    stage_type = callspec.params.get("stage_type") if callspec is not None else None
    return item.path.name + (f"-{stage_type}" if stage_type else "")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Tests on Unsloth's generated trainers run last: forcing them rewrites TRL's module attributes (and some of
    its helpers) for the rest of the process, and every other test checks the classes a CPU run really uses.
    A test using a fixture that trains, or marked long, is marked slow (`make test-fast` leaves them out)."""
    import torch

    items.sort(key=uses_unsloth_trainers)
    for item in items:
        if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())) or "long" in item.keywords:
            item.add_marker(pytest.mark.slow)  # a long test's subprocesses train too: make test-fast leaves it out
        if "precision" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.precision)  # `make test-other-cpu` runs these again
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()  # the libraries and the collected tests: see frozen_heap


def pytest_xdist_node_collection_finished(node, ids):
    """Under `--dist loadgroup` every test must reach xdist's scheduler with its group (pytest-xdist appends `@group`
    to the node id). pytest 9.2 reads node ids from a field xdist 3.8 does not set, so each test became its own group:
    module fixtures were built once per worker (twice) and the Unsloth-trainer groups were not kept together. Stop
    at once rather than run a suite that silently costs twice as much."""
    if node.config.getoption("dist") == "loadgroup" and any("@" not in nodeid for nodeid in ids):
        import xdist

        pytest.exit(f"pytest {pytest.__version__} and pytest-xdist {xdist.__version__} lose each test's xdist_group "
                    f"(module fixtures would be built on every worker); install the versions pyproject.toml pins",
                    returncode=3)


@pytest.fixture(params=FAMILIES)
def trainer_family(request, monkeypatch) -> str:
    """Run the test once with TRL's own trainers and once with Unsloth's generated ones (what a GPU runs), forced
    on the CPU through KIT_TRAINERS (kitcli/training/trainers.py)."""
    monkeypatch.setenv("KIT_TRAINERS", request.param)
    return request.param


@pytest.fixture(scope="session", autouse=True)
def fast_tests_train_nothing(request):
    """Under `make test-fast` (-m "not slow") building a trainer fails: a test that trains, or uses a fixture that
    does (module and session fixtures included: this one is set up first), must be marked slow (or its fixture listed
    in TRAINING_FIXTURES). tests/test_structure.py checks that this guard is in force."""
    if (request.config.option.markexpr or "").replace(" ", "") != "notslow":
        yield False
        return
    from kitcli.ppo import trainer as ppo_trainer
    from kitcli.training import trainers

    def refuse(*args, **kwargs):
        pytest.fail("a test builds a trainer under `make test-fast`: mark it slow", pytrace=False)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainers, "trainer_class", refuse)
        patch.setattr(ppo_trainer, "make_optimizer", refuse)
        yield True


PROCESS_ENVIRON = os.environ  # the mapping rich's Console reads (its class attribute), bound when rich is imported


def put_back_the_process_environ() -> None:
    """datasets' Dataset.map(num_proc=N) rebinds os.environ to a deep copy (datasets/arrow_dataset.py), and rich's
    consoles keep reading the original: a later test's COLUMNS (set in the copy) never reached them, and which test
    came after a map with num_proc depended on how xdist shared the files out. The original goes back, holding what
    the copy holds."""
    if os.environ is not PROCESS_ENVIRON:
        current = dict(os.environ)
        os.environ = PROCESS_ENVIRON  # noqa: B003 (cleared and refilled below)
        for key in set(os.environ) - set(current):
            del os.environ[key]
        os.environ.update(current)


@pytest.fixture(autouse=True)
def one_process_environ():
    put_back_the_process_environ()
    yield
    put_back_the_process_environ()


@pytest.fixture(autouse=True)
def console_size_from_the_environment(one_process_environ, monkeypatch):
    """A test that sets COLUMNS gets that width on any terminal. rich reads COLUMNS only where it has both sizes or
    the terminal is not a dumb one: with TERM=dumb (as CI runners set it) and a forced terminal (FORCE_COLOR), a
    console without LINES is 80 wide whatever COLUMNS says, and a table's columns wrap."""
    if "LINES" not in os.environ:
        monkeypatch.setenv("LINES", "50")


@pytest.fixture(autouse=True)
def frozen_heap():
    """After each test, collect its garbage and freeze what is left (gc.freeze): Python's collector then skips the
    imported libraries and the earlier tests' objects. accelerate calls gc.collect() at the start of every
    trainer.train(), and in a test process that has imported torch, transformers, TRL and Unsloth one full collection
    costs about 0.45 s: most of a short stage's training time."""
    yield
    gc.collect()
    gc.freeze()


# The precision modes of the formula tests that compare a loss (docs/conformance.md): "fp32", the float32 a CPU run
# trains in, and "bf16", the GPU's mixed precision (emulated on a CPU). KIT_PRECISION=fp32 or bf16 runs one of them;
# both by default. The fp32 case keeps the test's id as it was (tests/mutants.py names tests by id); the other ends
# in -bf16.
PRECISION_ENV = "KIT_PRECISION"
_precision_choice = os.environ.get(PRECISION_ENV, "both").strip().lower() or "both"
if _precision_choice not in ("fp32", "bf16", "both"):
    raise pytest.UsageError(f"{PRECISION_ENV}={os.environ[PRECISION_ENV]!r}: expected fp32, bf16 or both")
PRECISIONS = tuple(p for p in ("fp32", "bf16") if _precision_choice in (p, "both"))


@pytest.fixture(params=PRECISIONS, ids=[getattr(pytest, "HIDDEN_PARAM", "fp32") if p == "fp32" else p
                                        for p in PRECISIONS])
def precision(request, monkeypatch):
    """Run a formula test in float32 (as a CPU run trains) and at the GPU's precision: the kit's GPU dtype settings
    (bf16=True) in every config the test builds, Unsloth's bf16 autocast latched for its loss from them, the test's
    own forwards under bf16 autocast (helpers.emulate_gpu_precision; on a GPU, the real thing). Its tolerances in
    bf16 are measured on the test's own batch (helpers.PrecisionGap); in float32 they are the float32 ones."""
    import torch
    from helpers import at_precision, emulate_gpu_precision, forget_unsloth_cpu_bf16

    if request.param == "fp32" and torch.cuda.is_available():
        pytest.skip("float32 is the CPU's mode: on a GPU the kit trains in bf16 (kitcli/training/trl_config.py), "
                    "which the bf16 case runs for real")
    if request.param == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16: the kit trains in fp16 there, which no case here runs")
    # kitcli/training/trainers.py exports ACCELERATE_MIXED_PRECISION for each trainer it builds, and transformers
    # 5 reads it into a config with bf16 and fp16 False (TrainingArguments.__post_init__: mixed_precision): a
    # float32 config built after a bf16 trainer in one process would autocast in bf16. Each case starts from "no"
    # and leaves the variable as it found it.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    if request.param == "bf16" and not torch.cuda.is_available():
        emulate_gpu_precision(monkeypatch)
    with at_precision(request.param):
        yield request.param
    forget_unsloth_cpu_bf16()  # read UNSLOTH_CPU_BF16 afresh once monkeypatch has put it back


@pytest.fixture(params=[False, True], ids=["cpu-without-bf16", "cpu-with-bf16"])
def unsloth_cpu_bf16(request, monkeypatch) -> bool:
    """Unsloth's CPU backend answering as on a CPU without native bf16 (an AVX2-only EPYC) and as on one with it
    (AVX512-BF16 / AMX), whichever CPU runs the test (UNSLOTH_CPU_BF16)."""
    from helpers import forget_unsloth_cpu_bf16, set_unsloth_cpu_bf16

    set_unsloth_cpu_bf16(monkeypatch, native=request.param)
    yield request.param
    forget_unsloth_cpu_bf16()


@pytest.fixture
def family(trainer_family) -> str:
    """The trainer family of a test (`pytestmark = pytest.mark.usefixtures("family")` runs a whole file on both)."""
    return trainer_family


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from kitcli.models.tiny import ensure_tiny_model

    return ensure_tiny_model(seed=0)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run the test from an empty directory, so default run directories land in tmp_path."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, tiny_model_dir) -> Path:
    """One finished run for the commands that read a run (chat, generate, export): eval -> a short SFT -> eval."""
    from helpers import DATA, run_cli, write_recipe

    root = tmp_path_factory.mktemp("trained")
    held_out = {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 4}
    stages = [{"name": "eval-before", "type": "eval", "data": held_out, "generation": {"max_new_tokens": 4}},
              {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
               "train": {"max_steps": 12, "learning_rate": 3e-3, "per_device_train_batch_size": 16,
                         "logging_steps": 6, "save_steps": 100}},
              {"name": "eval-after", "type": "eval", "init": "sft", "data": held_out,
               "generation": {"max_new_tokens": 4}}]
    run_cli("run", write_recipe(root / "recipe.yaml", stages, name="export-test"), "--output", root / "run")
    return root / "run"
