"""Mutation check: break the code on purpose, one break at a time, and see the test that guards it go red.

    make mutants                          # every mutant (the 19 precision mutants: about 22 minutes, 2 cores)
    .venv/bin/python tests/mutants.py --list
    .venv/bin/python tests/mutants.py grpo-kl-dropped dpo-pairs-swapped

Each mutant replaces one snippet of source (the kit's, or an installed library's where the kit relies on it: TRL's
KL term, its leave-one-out baseline) in a copy of the tree, then runs the tests named with it. A mutant is killed
when those tests fail on the copy (`each`: every one of them; otherwise the first failure stops the run); the same
tests are run unbroken first (`--no-baseline` skips that), so a test that fails for another reason is not counted as
a kill. Nothing in this checkout or in .venv is changed: the copy goes first on PYTHONPATH (the editable install's
finder comes after it), a library file is mutated in a copy of its package, and Unsloth compiles its trainers from
the mutated source into the copy's own cache. For the formula tests, the comparison that failed is printed with its
margin (difference / tolerance: tests/same_forward.py records each comparison).

Not part of `make test`: a mutant costs a pytest process (Unsloth's import) and a short training run or two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))
CONFORMANCE_LOG = "KIT_CONFORMANCE_LOG"  # where the formula tests record their comparisons (tests/same_forward.py)


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str  # relative to the checkout, or "site:<package>/<file>" for an installed library
    old: str
    new: str
    tests: tuple[str, ...]
    select: str = ""  # pytest -k: one case of a parametrized test
    each: bool = False  # every test must fail (all run; otherwise the first failure kills, pytest -x)


def bf16_cases(test: str, *params: str) -> tuple[str, ...]:
    """A formula test's bf16 cases on both trainer families (`params`: the test's own parameters after the mode)."""
    return tuple(f"tests/{test}[{'-'.join((family, 'bf16', *params))}]" for family in ("trl", "unsloth"))


GRPO = "site:trl/trainer/grpo_trainer.py"
ZOO = "site:unsloth_zoo/rl_replacements.py"  # Unsloth's GRPO loss, copied into its generated trainer
LOSS_START = "    def _compute_loss(self, model, inputs, return_outputs):\n"  # DPO's and KTO's, after the kit's checks
EPSILONS = ("        self.epsilon_low = args.epsilon\n"
            "        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon\n")
GRPO_LOSS = "test_rl_formulas.py::test_grpo_loss_matches_deepseekmath_formula"
AGGREGATIONS = "test_rl_formulas.py::test_token_level_aggregations"
DPO_SIGMOID = "per_sequence_loss = -F.logsigmoid(self.beta * delta_score)\n"
# Issue 50's mutants: a value the trainer uses changed where the test's config assertions cannot see it (in __init__
# for a preset's value, which the kit notes and keeps; where the loss reads it for a value the recipe set, which the
# kit would refuse at build), or a term of its loss changed. Each must fail the GPU's precision mode (the -bf16
# cases, emulated on a CPU) on each trainer family it reaches: Unsloth's trainers are compiled from the mutated TRL
# source, but for GRPO's loss (unsloth_zoo's). Their margins (difference / tolerance) are in docs/conformance.md.
PRECISION_MUTANTS = [
    Mutant("grpo-beta-20pct-low", "GRPO's KL coefficient 20% below the config's (0.5 -> 0.4) in TRL's loss", GRPO,
           "per_token_loss = per_token_loss + self.beta * per_token_kl",
           "per_token_loss = per_token_loss + 0.8 * self.beta * per_token_kl", bf16_cases(GRPO_LOSS)[:1]),
    Mutant("grpo-beta-20pct-low-unsloth", "the same in Unsloth's GRPO loss (unsloth_zoo's grpo_compute_loss)", ZOO,
           "loss_i = loss_i + beta * kl_i", "loss_i = loss_i + 0.8 * beta * kl_i", bf16_cases(GRPO_LOSS)[1:]),
    Mutant("grpo-epsilon-0.25", "GRPO's clip range 0.2 -> 0.25", GRPO,
           EPSILONS, EPSILONS.replace("= args.epsilon\n", "= args.epsilon + 0.05\n"), bf16_cases(GRPO_LOSS),
           each=True),
    Mutant("grpo-normalised-as-dr-grpo", "GRPO's loss divided by G x max_completion_length (Dr. GRPO's) instead of "
           "averaged per sequence (TRL's loss)", GRPO,
           "if self.loss_type in [\"grpo\", \"sapo\"]:\n"
           "            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
           "if self.loss_type in [\"grpo\", \"sapo\"]:\n"
           "            loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)",
           bf16_cases(GRPO_LOSS)[:1]),
    Mutant("grpo-normalised-as-dr-grpo-unsloth", "the same in Unsloth's GRPO loss (unsloth_zoo's grpo_compute_loss)",
           ZOO,
           "elif loss_type in [\"grpo\", \"sapo\"]:\n"
           "        loss = ((loss_i * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
           "elif loss_type in [\"grpo\", \"sapo\"]:\n"
           "        loss = (loss_i * mask).sum() / (loss_i.size(0) * max_completion_length)",
           bf16_cases(GRPO_LOSS)[1:]),
    Mutant("gspo-token-ratio", "GSPO's sequence ratio replaced by the token ratios", GRPO,
           "self.importance_sampling_level = args.importance_sampling_level",
           "self.importance_sampling_level = \"token\"",
           bf16_cases("test_rl_formulas.py::test_gspo_sequence_ratio_and_clipped_objective"), each=True),
    Mutant("gspo-clip-range-x10", "GSPO's clip range ten times the paper's ([1 - 3e-3, 1 + 4e-3])", GRPO,
           EPSILONS, EPSILONS.replace("args.epsilon\n", "args.epsilon * 10\n").replace(
               "self.epsilon_high = ", "self.epsilon_high = 10 * "),
           bf16_cases("test_rl_formulas.py::test_gspo_sequence_ratio_and_clipped_objective"), each=True),
    Mutant("luspo-clip-range-x10", "LUSPO's clip range ten times the paper's", GRPO,
           EPSILONS, EPSILONS.replace("args.epsilon\n", "args.epsilon * 10\n").replace(
               "self.epsilon_high = ", "self.epsilon_high = 10 * "),
           bf16_cases("test_rl_formulas.py::test_luspo_scales_each_sequence_term_by_its_length"), each=True),
    Mutant("dapo-epsilon-0.25", "DAPO's lower clip 0.2 -> 0.25", GRPO,
           EPSILONS, EPSILONS.replace("= args.epsilon\n", "= args.epsilon + 0.05\n"),
           bf16_cases(AGGREGATIONS, "dapo"), each=True),
    Mutant("dapo-clip-higher-dropped", "DAPO's clip-higher dropped (epsilon_high 0.28 -> 0.2)", GRPO,
           EPSILONS, EPSILONS.replace("args.epsilon_high if", "args.epsilon if"),
           bf16_cases(AGGREGATIONS, "dapo"), each=True),
    Mutant("dr-grpo-epsilon-0.25", "Dr. GRPO's clip range 0.2 -> 0.25", GRPO,
           EPSILONS, EPSILONS.replace("= args.epsilon\n", "= args.epsilon + 0.05\n"),
           bf16_cases(AGGREGATIONS, "dr_grpo"), each=True),
    Mutant("bnpo-epsilon-0.25", "BNPO's clip range 0.2 -> 0.25", GRPO,
           EPSILONS, EPSILONS.replace("= args.epsilon\n", "= args.epsilon + 0.05\n"),
           bf16_cases(AGGREGATIONS, "bnpo"), each=True),
    Mutant("rloo-epsilon-0.25", "RLOO's lower clip 0.2 -> 0.25", "site:trl/trainer/rloo_trainer.py",
           EPSILONS, EPSILONS.replace("= args.epsilon\n", "= args.epsilon + 0.05\n"),
           bf16_cases("test_rloo_formulas.py::test_clipped_sequence_ratio_loss"), each=True),
    Mutant("dpo-beta-0.25", "DPO's beta 0.3 -> 0.25 once it trains (after the kit checked the trainer)",
           "site:trl/trainer/dpo_trainer.py", LOSS_START, LOSS_START + "        self.beta = self.args.beta - 0.05\n",
           bf16_cases("test_preference_formulas.py::test_dpo_loss_is_the_reference_formula"), each=True),
    Mutant("dpo-label-smoothing", "DPO's sigmoid loss with label smoothing 0.1 (conservative DPO)",
           "site:trl/trainer/dpo_trainer.py", DPO_SIGMOID,
           "per_sequence_loss = -0.9 * F.logsigmoid(self.beta * delta_score) - 0.1 * F.logsigmoid(-self.beta * "
           "delta_score)\n",
           bf16_cases("test_preference_formulas.py::test_dpo_loss_is_the_reference_formula"), each=True),
    Mutant("dpo-sft-reference-label-smoothing", "the same, in the DPO-reference-is-SFT test",
           "site:trl/trainer/dpo_trainer.py", DPO_SIGMOID,
           "per_sequence_loss = -0.9 * F.logsigmoid(self.beta * delta_score) - 0.1 * F.logsigmoid(-self.beta * "
           "delta_score)\n",
           bf16_cases("test_trainer_families.py::test_dpo_reference_is_the_sft_model"), each=True),
    Mutant("kto-beta-0.25", "KTO's beta 0.3 -> 0.25 once it trains", "site:trl/trainer/kto_trainer.py",
           LOSS_START, LOSS_START + "        self.beta = self.args.beta - 0.05\n",
           bf16_cases("test_kto_formulas.py::test_kto_loss_is_the_reference_formula"), each=True),
    Mutant("kto-beta-halved", "KTO's beta halved once it trains", "site:trl/trainer/kto_trainer.py",
           LOSS_START, LOSS_START + "        self.beta = self.args.beta / 2\n",
           bf16_cases("test_kto_formulas.py::test_kto_loss_is_the_reference_formula"), each=True),
    Mutant("bradley-terry-centering-dropped", "the reward model's centering term left out of its loss",
           "site:trl/trainer/reward_trainer.py",
           "if self.args.center_rewards_coefficient is not None:", "if False:",
           bf16_cases("test_preference_formulas.py::test_bradley_terry_loss_is_the_reference_formula"), each=True),
]


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
    *PRECISION_MUTANTS,
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


def run_tests(tree: Path, mutant: Mutant, log: Path | None = None) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / '_site'}",
           "KIT_HOME": str(ROOT / ".pytest_kit_home"),  # the tiny model and GGUF caches, built once
           "UNSLOTH_COMPILE_LOCATION": str(tree / "unsloth_compiled_cache")}  # compiled from the (mutated) source
    env.pop("PYTEST_XDIST_WORKER", None)
    if log is not None:
        env[CONFORMANCE_LOG] = str(log)
    select = ["-k", mutant.select] if mutant.select else []
    stop = [] if mutant.each else ["-x"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", *stop, "-p", "no:cacheprovider", *select,
                           *mutant.tests], cwd=tree, env=env, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def verdict(code: int, output: str) -> str:
    """passed, failed, or partly (some tests passed: a mutant whose tests must each fail is not killed)."""
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    if code == 1 and re.search(r"\b\d+ passed\b", summary):
        return "partly"
    return {0: "passed", 1: "failed"}.get(code, f"error (pytest exit {code})")


def margins(log: Path) -> list[str]:
    """Per formula test, the comparison that failed it (the first over its tolerance: the test stops there), as
    difference / tolerance (tests/same_forward.py records each comparison)."""
    first: dict[str, dict] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        record = json.loads(line)
        if record["difference"] > record["tolerance"]:
            first.setdefault(record["test"], record)
    return [f"{'':32} {test.split('::')[-1]}: {r['check']} {r['difference']:.2e} against {r['tolerance']:.2e}, "
            f"{r['difference'] / r['tolerance']:.3g} times" for test, r in first.items()]


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
            before = "-" if args.no_baseline else verdict(*run_tests(tree, mutant))
            path.write_text(source.replace(mutant.old, mutant.new))
            log = tree / f"{mutant.name}.margins.jsonl"
            try:
                code, output = run_tests(tree, mutant, log)
            finally:
                path.write_text(source)
            after = verdict(code, output)
            killed = after == "failed" and before in ("passed", "-")
            if not killed:
                survivors.append(mutant.name)
                print(output[-3000:])
            print(f"{mutant.name:32} {before:8} {after:8} {time.perf_counter() - started:7.0f}  "
                  f"{' '.join(t.split('::')[-1] for t in mutant.tests)}", *margins(log), sep="\n", flush=True)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutants killed"
          + (f"; not killed: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
