"""Mutation check: break the code on purpose, one break at a time, and see the test that guards it go red.

    make mutants                          # every mutant (about 15 minutes on 2 cores)
    .venv/bin/python tests/mutants.py --list
    .venv/bin/python tests/mutants.py grpo-kl-dropped dpo-pairs-swapped

Each mutant replaces one snippet of source (the kit's, or an installed library's where the kit relies on it: TRL's
KL term, its leave-one-out baseline) in a copy of the tree, then runs the tests named with it. A mutant is killed
when those tests fail on the copy; the same tests are run unbroken first (`--no-baseline` skips that), so a test
that fails for another reason is not counted as a kill. Nothing in this checkout or in .venv is changed: the copy
goes first on PYTHONPATH (the editable install's finder comes after it), a library file is mutated in a copy of its
package, and Unsloth compiles its trainers from the mutated source into the copy's own cache.

Not part of `make test`: a mutant costs a pytest process (Unsloth's import) and a short training run or two.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str  # relative to the checkout, or "site:<package>/<file>" for an installed library
    old: str
    new: str
    tests: tuple[str, ...]
    select: str = ""  # pytest -k: one case of a parametrized test


MUTANTS = [
    Mutant("grpo-kl-dropped", "GRPO's KL term left out of the loss",
           "site:trl/trainer/grpo_trainer.py",
           "per_token_loss = per_token_loss + self.beta * per_token_kl",
           "per_token_loss = per_token_loss",
           ("tests/test_rl_formulas.py::test_grpo_loss_matches_deepseekmath_formula[trl]",)),
    Mutant("grpo-kl-sign-flipped", "GRPO's KL term added with the wrong sign (a reward for moving away)",
           "site:trl/trainer/grpo_trainer.py",
           "per_token_loss = per_token_loss + self.beta * per_token_kl",
           "per_token_loss = per_token_loss - self.beta * per_token_kl",
           ("tests/test_rl_formulas.py::test_grpo_loss_matches_deepseekmath_formula[trl]",)),
    Mutant("grpo-reference-follows-policy", "GRPO's reference log-probs from the live policy, not the frozen copy",
           "site:trl/trainer/grpo_trainer.py",
           'with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):',
           'with use_adapter(model, adapter_name="default"):',
           ("tests/test_rl_formulas.py::test_grpo_loss_matches_deepseekmath_formula[trl]",
            "tests/test_trainer_families.py::test_grpo_kl_is_zero_at_the_start_and_grows_as_the_policy_moves[trl]")),
    Mutant("kit-reference-is-the-base", "the kit's reference adapter (Unsloth's trainers) left at its fresh init",
           "kitcli/training/trainers.py",
           "copy.copy_(start.get(name, param))",
           "pass",
           ("tests/test_trainer_families.py::test_grpo_kl_is_zero_at_the_start_and_grows_as_the_policy_moves"
            "[unsloth]",)),
    Mutant("rloo-baseline-includes-self", "RLOO's baseline is the group mean (itself included), not leave-one-out",
           "site:trl/trainer/rloo_trainer.py",
           "baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)",
           "baselines = grouped_sum / scorable_counts",
           ("tests/test_rloo_formulas.py::test_leave_one_out_advantage_without_kl[trl]",)),
    Mutant("chat-without-the-adapter", "kit chat / kit generate load the base model without the stage's adapter",
           "kitcli/commands/chat.py",
           "seed=policy.recipe.get(\"seed\", 42), init_from=policy.stage_dir,",
           "seed=policy.recipe.get(\"seed\", 42), init_from=None,",
           ("tests/test_chat_generate.py::test_chat_and_generate_answer_with_the_stage_adapter_not_the_base",)),
    Mutant("adapter-not-loaded", "a stage's saved adapter is not loaded into the policy that starts from it",
           "kitcli/models/backend.py",
           "        load_adapter_weights(model, adapter_dir)\n",
           "        pass\n",
           ("tests/test_gspo_stage.py::test_gspo_adapter_reloads",)),
    Mutant("finished-stages-rerun", "kit run runs a finished stage again (its DONE ignored)",
           "kitcli/run/runner.py",
           "if done is not None and not force:",
           "if False:",
           ("tests/test_grpo_stage.py::test_bad_reward_stops_the_stage_naming_reward_and_sample",), select="nan"),
    Mutant("trainer-rewrites-after-build", "the built trainer's config changes after the kit checked it",
           "kitcli/training/trainers.py",
           "    described = ensure_reference(trainer, start, where) if reference else None\n",
           "    if hasattr(trainer.args, 'mask_truncated_completions'):\n"
           "        trainer.args.mask_truncated_completions = True\n"
           "    described = ensure_reference(trainer, start, where) if reference else None\n",
           ("tests/test_grpo_stage.py::test_grpo_config_records_the_preset_and_reward_weights",)),
    Mutant("dpo-pairs-swapped", "DPO trains on its pairs with chosen and rejected swapped",
           "kitcli/stages/dpo.py",
           "    config = config or make_config(ctx)\n",
           "    config = config or make_config(ctx)\n"
           "    train_rows = [{**r, 'chosen': r['rejected'], 'rejected': r['chosen']} for r in train_rows]\n",
           ("tests/test_dpo_stage.py::test_dpo_widens_the_margin_of_the_preferred_completion",)),
    Mutant("rewards-negated", "the trainer gets each reward's scores with the sign flipped",
           "rewards/guard.py",
           "            return scores\n        finally:",
           "            return [None if s is None else -s for s in scores]\n        finally:",
           ("tests/test_grpo_stage.py::test_grpo_raises_the_reward_it_is_trained_on",)),
    Mutant("resume-reshuffles-later-passes", "a resumed RL stage shuffles a later pass over its prompts like the first",
           "kitcli/training/checkpoints.py",
           "    replay_sampler_passes(trainer)\n",
           "",
           ("tests/test_resume.py::test_sigkill_resumes_exactly",), select="grpo-pass_boundary or rloo-third_pass"),
    Mutant("resume-regroups-later-passes", "a resumed length-grouped SFT stage shuffles a later pass from the "
           "global RNG (transformers' own LengthGroupedSampler)",
           "kitcli/training/checkpoints.py",
           "            made.set_epoch = lambda epoch: made.generator.manual_seed(data_seed + epoch)\n",
           "            made.generator = None\n",
           ("tests/test_resume.py::test_a_length_grouped_sft_stage_resumes_exactly_in_a_later_pass",)),
    Mutant("held-out-eval-reseeds-training", "a held-out evaluation inside a training stage leaves torch's RNG as "
           "generate() seeded it",
           "kitcli/training/held_out.py",
           "        torch.set_rng_state(states[2])\n",
           "",
           ("tests/test_held_out.py::test_grpo_with_eval_trains_bit_identically_and_resumes_without_repeating_an_"
            "evaluation",)),
    Mutant("held-out-eval-repeated-on-resume", "a resumed stage evaluates its held-out rows again at its first step",
           "kitcli/training/held_out.py",
           "            if state.global_step == 0:",
           "            if True:",
           ("tests/test_held_out.py::test_grpo_with_eval_trains_bit_identically_and_resumes_without_repeating_an_"
            "evaluation",)),
    Mutant("resume-trains-past-max-steps", "a stage resumed from its checkpoint at max_steps trains again "
           "(transformers' resume: one step and one checkpoint past max_steps)",
           "kitcli/training/checkpoints.py",
           "    if finished_steps(checkpoint) is not None:\n",
           "    if False:\n",
           ("tests/test_resume.py::test_sigkill_resumes_exactly",),
           select="sft-final_checkpoint or grpo-final_checkpoint"),
    Mutant("judge-takes-a-probe-twice", "the judge takes a value the sandbox reported twice (the last one wins)",
           "rewards/judge.py",
           "if probe in values[test] or probe in why[test]:",
           "if probe in why[test]:",
           ("tests/test_rewards_hacks.py::test_reports_are_taken_once_each_or_the_test_fails",)),
    Mutant("judge-ignores-exit-status", "a program that printed the expected output passes whatever its exit",
           "rewards/sandbox.py",
           'if status != 0 or f"stdout {number}" in run.overflowed:',
           'if f"stdout {number}" in run.overflowed:',
           ("tests/test_rewards_sandbox.py::test_a_program_passes_a_stdin_stdout_test_only_when_it_also_exits_0",)),
    Mutant("score-range-unchecked", "a score outside the reward's declared range goes to the trainer",
           "rewards/guard.py",
           "return [(i, s) for i, s in enumerate(scores) if s is not None and not low <= s <= high]",
           "return []",
           ("tests/test_rewards_guard.py::test_a_score_outside_the_declared_range_stops_the_run",)),
]


def copy_tree(into: Path) -> None:
    """The checkout's files as git sees them (tracked and untracked-not-ignored), without .venv and caches."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def target(mutant: Mutant, tree: Path) -> Path:
    if not mutant.path.startswith("site:"):
        return tree / mutant.path
    relative = Path(mutant.path.removeprefix("site:"))
    package = relative.parts[0]
    if not (tree / "_site" / package).exists():
        shutil.copytree(SITE / package, tree / "_site" / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tree / "_site" / relative


def run_tests(tree: Path, mutant: Mutant) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / '_site'}",
           "KIT_HOME": str(ROOT / ".pytest_kit_home"),  # the tiny model and GGUF caches, built once
           "UNSLOTH_COMPILE_LOCATION": str(tree / "unsloth_compiled_cache")}  # compiled from the (mutated) source
    env.pop("PYTEST_XDIST_WORKER", None)
    select = ["-k", mutant.select] if mutant.select else []
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *select,
                           *mutant.tests], cwd=tree, env=env, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def verdict(code: int) -> str:
    return {0: "passed", 1: "failed"}.get(code, f"error (pytest exit {code})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip running each test unbroken first")
    args = parser.parse_args()
    known = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:32} {m.what}\n{'':32} {', '.join(m.tests)}")
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"unknown mutant(s): {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = [known[n] for n in args.names] or MUTANTS
    survivors = []
    print(f"{'mutant':32} {'before':8} {'after':8} seconds  test")
    with tempfile.TemporaryDirectory(prefix="kit-mutants-") as temp:
        tree = Path(temp)
        copy_tree(tree)
        for mutant in chosen:
            started = time.perf_counter()
            path = target(mutant, tree)
            source = path.read_text()
            if source.count(mutant.old) != 1:
                print(f"{mutant.name:32} the snippet to break is not in {mutant.path} exactly once: update the mutant")
                survivors.append(mutant.name)
                continue
            before = "-" if args.no_baseline else verdict(run_tests(tree, mutant)[0])
            path.write_text(source.replace(mutant.old, mutant.new))
            try:
                code, output = run_tests(tree, mutant)
            finally:
                path.write_text(source)
            after = verdict(code)
            killed = code == 1 and before in ("passed", "-")
            if not killed:
                survivors.append(mutant.name)
                print(output[-3000:])
            print(f"{mutant.name:32} {before:8} {after:8} {time.perf_counter() - started:7.0f}  "
                  f"{' '.join(t.split('::')[-1] for t in mutant.tests)}", flush=True)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutants killed"
          + (f"; not killed: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
