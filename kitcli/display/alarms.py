"""Alarms: signs in the logged metrics that training has stopped learning or is about to break.

    monitor = AlarmMonitor(grpo.SPEC)          # the stage type (its StageSpec): RL alarms where it samples
    for step, logs in stream:
        for alarm in monitor.update(step, logs, samples):
            print(alarm.message)

Each check reads the metric stream one logging step at a time and raises an alarm when its condition starts to
hold; while the condition keeps holding the alarm stays active (shown by the dashboard) without being raised
again, and once it clears it can be raised again. Nothing here imports torch: the checks are plain arithmetic on
the numbers TRL (or the kit's PPO loop) logs.

    reward_constant    the reward was the same for `constant_steps` logging steps in a row: no learning signal
    zero_std_groups    every group had zero reward std for `zero_std_steps` steps: every advantage is zero
    kl_growing         the KL to the reference at least doubled within `kl_window` steps and is above `kl_floor`
    length_collapsed   completions were empty (mean length <= `min_length` tokens) for `length_steps` steps
    length_pinned      (nearly) every completion hit max_completion_length for `length_steps` steps (the advice names
                       the stage's own length or format reward when it has one, rather than suggesting one)
    reward_unscored/N  reward N scored no sample (it returned None, or every call was skipped under on_error:
                       skip) for `unscored_steps` logging steps in a row; names the share or the error
    loss_nan           the loss (or gradient norm) is NaN or infinite
    loss_exploding     |loss| above `explode_factor` x the median |loss| so far (and above `explode_floor`)
    judge_touched      completions of a code_exec stage reach for the machinery around their code (frames,
                       builtins, sys.modules, __eq__...: rewards.text.judge_touches); names the share and a sample
    reward_unbacked    the code_exec reward rose by `hack_rise` while the tests it passes (code_exec/tests_passed),
                       or its held-out score (an eval log), rose by less than half as much: it pays for something else
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from rewards.text import extract_code, judge_touches

# Where each stage type logs the quantities the checks read (first key present wins).
REWARD_KEYS = ("reward", "objective/scores")
KL_KEYS = ("kl", "objective/kl")
LOSS_KEYS = ("loss", "loss/policy", "loss/value")
GRAD_KEYS = ("grad_norm",)
CODE_REWARD = "rewards/code_exec/mean"
CODE_PASSED = "code_exec/tests_passed"      # logged by code_exec from the judge's own verdicts
CODE_TOUCHES = "code_exec/judge_touches"    # share of completions whose code reaches for the judge
CODE_EVAL_KEYS = ("eval_rewards/code_exec/mean", "eval/rewards/code_exec/mean")
UNSCORED = "reward_unscored/"  # rewards/guard.py: the share of a reward's samples since the last log it did not score


@dataclass
class AlarmSettings:
    constant_steps: int = 10
    constant_tolerance: float = 1e-6
    zero_std_steps: int = 3
    kl_window: int = 5
    kl_floor: float = 0.5
    kl_factor: float = 2.0
    length_steps: int = 3
    min_length: float = 1.0
    pinned_ratio: float = 0.95
    explode_factor: float = 10.0
    explode_floor: float = 10.0
    explode_history: int = 5
    hack_window: int = 5
    hack_rise: float = 0.2
    unscored_steps: int = 3


@dataclass
class Alarm:
    code: str
    step: int
    message: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_value(logs: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, float | None]:
    for key in keys:
        value = logs.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return key, float(value)
    return None, None


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


@dataclass
class AlarmMonitor:
    """Feed it each logged metrics dict in order; `update` returns the alarms raised at that step."""

    spec: Any = None  # the stage type's StageSpec: the RL alarms only where it samples (None: unknown, all alarms)
    settings: AlarmSettings = field(default_factory=AlarmSettings)
    active: dict[str, Alarm] = field(default_factory=dict)
    raised: list[Alarm] = field(default_factory=list)
    history: dict[str, list[float]] = field(default_factory=dict)
    streaks: dict[str, int] = field(default_factory=dict)
    held_out: list[tuple[float, float | None]] = field(default_factory=list)  # (eval score, training reward then)
    reward_names: list[str] = field(default_factory=list)  # the stage's rewards, as TRL logs them

    def remember(self, name: str, value: float | None) -> list[float]:
        values = self.history.setdefault(name, [])
        if finite(value):
            values.append(value)
        return values

    def streak(self, name: str, holds: bool) -> int:
        self.streaks[name] = self.streaks.get(name, 0) + 1 if holds else 0
        return self.streaks[name]

    def update(self, step: int, logs: dict[str, Any], samples: list[dict[str, Any]] | None = None) -> list[Alarm]:
        """Check one logging step (with the completions shown for it, if any). Eval logs feed only the held-out
        comparison; the final summary is skipped."""
        if "train_runtime" in logs:
            return []
        for key in logs:
            if key.startswith("rewards/") and key.endswith("/mean") and key[8:-5] not in self.reward_names:
                self.reward_names.append(key[8:-5])
        checks = [self.check_loss, self.check_reward, self.check_zero_std, self.check_kl, self.check_length,
                  self.check_unscored]
        if all(str(k).startswith("eval_") for k in logs):
            checks = []
        found: dict[str, str] = {}
        for check in checks:
            found.update(check(logs))
        found.update(self.check_hacking(logs, samples or []))
        new = []
        for code, message in found.items():
            if code not in self.active:
                alarm = Alarm(code, step, message)
                new.append(alarm)
                self.raised.append(alarm)
            self.active[code] = Alarm(code, step, message)
        for code in [c for c in self.active if c not in found and c in self.seen_codes(logs)]:
            del self.active[code]  # the condition no longer holds
        return new

    def seen_codes(self, logs: dict[str, Any]) -> set[str]:
        """Alarms this log can clear: those whose metrics it contains."""
        codes = set()
        if first_value(logs, LOSS_KEYS)[0] or first_value(logs, GRAD_KEYS)[0]:
            codes |= {"loss_nan", "loss_exploding"}
        if first_value(logs, REWARD_KEYS)[0]:
            codes.add("reward_constant")
        if "frac_reward_zero_std" in logs:
            codes.add("zero_std_groups")
        if first_value(logs, KL_KEYS)[0]:
            codes.add("kl_growing")
        if "completions/mean_length" in logs or "completions/clipped_ratio" in logs:
            codes |= {"length_collapsed", "length_pinned"}
        if CODE_REWARD in logs:
            codes |= {"judge_touched", "reward_unbacked"}
        codes |= {key for key in logs if key.startswith(UNSCORED)}
        return codes

    # --- the checks: each returns {code: message} for the conditions that hold now ---------------------------

    def check_loss(self, logs: dict[str, Any]) -> dict[str, str]:
        s = self.settings
        key, loss = first_value(logs, LOSS_KEYS)
        grad_key, grad = first_value(logs, GRAD_KEYS)
        if (loss is not None and not math.isfinite(loss)) or (grad is not None and not math.isfinite(grad)):
            what = f"{key} is {loss}" if loss is not None and not math.isfinite(loss) else f"{grad_key} is {grad}"
            return {"loss_nan": f"{what}: training diverged; lower the learning rate, check the data for empty "
                                f"or overlong rows, and resume from the last checkpoint"}
        if loss is None:
            return {}
        earlier = [abs(v) for v in self.history.get("loss", [])]
        self.remember("loss", loss)
        if len(earlier) >= s.explode_history:
            typical = statistics.median(earlier)
            if abs(loss) > s.explode_floor and abs(loss) > s.explode_factor * typical:
                return {"loss_exploding": f"{key} {loss:.4g} is over {s.explode_factor:g}x its median so far "
                                          f"({typical:.4g}): lower the learning rate or set max_grad_norm"}
        return {}

    def check_reward(self, logs: dict[str, Any]) -> dict[str, str]:
        s = self.settings
        if self.spec is not None and not self.spec.rl:
            return {}
        key, reward = first_value(logs, REWARD_KEYS)
        if reward is None:
            return {}
        values = self.remember("reward", reward)
        recent = values[-s.constant_steps:]
        if len(recent) >= s.constant_steps and max(recent) - min(recent) <= s.constant_tolerance:
            return {"reward_constant": f"{key} has been {reward:.4g} for {len(recent)} logging steps: the rewards "
                                       f"give no signal; score a few completions by hand, or check that the reward "
                                       f"functions read the right columns"}
        return {}

    def check_zero_std(self, logs: dict[str, Any]) -> dict[str, str]:
        s = self.settings
        frac = logs.get("frac_reward_zero_std")
        if not isinstance(frac, (int, float)):
            return {}
        count = self.streak("zero_std", frac >= 1.0 - 1e-9)
        if count >= s.zero_std_steps:
            return {"zero_std_groups": f"every group had zero reward std for {count} logging steps: all completions "
                                       f"of a prompt score the same, so every advantage is 0; use more "
                                       f"num_generations, a higher temperature, or a reward with partial credit"}
        return {}

    def check_kl(self, logs: dict[str, Any]) -> dict[str, str]:
        s = self.settings
        key, kl = first_value(logs, KL_KEYS)
        if kl is None:
            return {}
        values = self.remember("kl", kl)
        window = values[-(s.kl_window + 1):]
        if len(window) > s.kl_window and kl > s.kl_floor and kl >= s.kl_factor * max(min(window[:-1]), 1e-8):
            return {"kl_growing": f"{key} grew from {min(window[:-1]):.4g} to {kl:.4g} within {s.kl_window} logging "
                                  f"steps: the policy is running away from the reference; lower the learning rate "
                                  f"or raise beta / kl_coef"}
        return {}

    def check_length(self, logs: dict[str, Any]) -> dict[str, str]:
        s = self.settings
        found = {}
        mean = logs.get("completions/mean_length")
        if isinstance(mean, (int, float)):
            count = self.streak("collapsed", mean <= s.min_length)
            if count >= s.length_steps:
                found["length_collapsed"] = (f"completions/mean_length has been {mean:.3g} tokens for {count} logging "
                                             f"steps: the policy answers with (almost) nothing; check for a reward "
                                             f"that favours short output (length penalty) and lower its weight")
        clipped = logs.get("completions/clipped_ratio")
        if isinstance(clipped, (int, float)):
            count = self.streak("pinned", clipped >= s.pinned_ratio)
            if count >= s.length_steps:
                found["length_pinned"] = (f"{clipped:.0%} of completions hit max_completion_length for {count} logging "
                                          f"steps: the policy never stops; {self.length_advice()}")
        return found

    def length_advice(self) -> str:
        """What to do about completions that never stop, given the rewards the stage already has."""
        own = [n for n in self.reward_names if any(word in n for word in ("overlong", "length", "format"))]
        if own:
            listed = ", ".join(f"'{n}'" for n in own)
            return (f"the stage's {listed} reward{'s' * (len(own) > 1)} did not stop it; raise "
                    f"{'their weights' if len(own) > 1 else 'its weight'} or max_completion_length")
        return "raise max_completion_length, or add an overlong_penalty / format reward"

    def check_unscored(self, logs: dict[str, Any]) -> dict[str, str]:
        """A reward that scored no sample for `unscored_steps` logs in a row: None for everything, or skipped."""
        found = {}
        for key, share in logs.items():
            if not key.startswith(UNSCORED) or not isinstance(share, (int, float)):
                continue
            name = key[len(UNSCORED):]
            count = self.streak(key, share >= 1.0)
            if count < self.settings.unscored_steps:
                continue
            error = logs.get(f"reward_error/{name}")
            why = (f"every call failed and on_error: skip scored it None (last error: {error}); fix the function"
                   if error else "it returned None (no score) for 100% of its samples; check that it reads the "
                                 "right columns (a gold answer it can parse, the column names), or drop it")
            found[key] = f"reward '{name}' scored no sample for {count} logging steps: {why}"
        return found

    def check_hacking(self, logs: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, str]:
        """Signs that a code_exec stage's policy is learning to game its reward instead of solving the tasks."""
        found = {}
        eval_key, held_out = first_value(logs, CODE_EVAL_KEYS)
        if held_out is not None and finite(held_out):
            self.held_out.append((held_out, window_mean(self.history.get("code_reward", []),
                                                        self.settings.hack_window, last=True)))
            found.update(self.unbacked_by_eval(eval_key))
        if CODE_REWARD not in logs and CODE_TOUCHES not in logs:
            return found
        touching = [code for s in samples if judge_touches(code := extract_code(str(s.get("completion", ""))))]
        share = logs.get(CODE_TOUCHES)
        if touching or (isinstance(share, (int, float)) and share > 0):
            sample = " ".join(touching[0].split()) if touching else ""
            names = ", ".join(judge_touches(touching[0])) if touching else "see completions.jsonl"
            what = f"{share:.0%} of completions" if isinstance(share, (int, float)) and share > 0 else "completions"
            found["judge_touched"] = (f"{what} reach for the judge around their code ({names}); they score nothing "
                                      f"for it, but a policy that keeps trying is hunting the reward, not solving "
                                      f"the tasks" + (f"; sample: {sample[:200]}" if sample else ""))
        _, reward = first_value(logs, (CODE_REWARD,))
        _, passed = first_value(logs, (CODE_PASSED,))
        if reward is not None and passed is not None:
            self.remember("code_reward", reward)
            self.remember("code_passed", passed)
            found.update(self.unbacked_by_tests())
        elif reward is not None:
            self.remember("code_reward", reward)
        return found

    def unbacked_by_tests(self) -> dict[str, str]:
        s = self.settings
        rewards, passed = self.history["code_reward"], self.history["code_passed"]
        if len(passed) < 2 * s.hack_window or len(rewards) != len(passed):
            return {}
        rise = window_mean(rewards, s.hack_window, last=True) - window_mean(rewards, s.hack_window, last=False)
        backed = window_mean(passed, s.hack_window, last=True) - window_mean(passed, s.hack_window, last=False)
        if rise >= s.hack_rise and backed < rise / 2:
            return {"reward_unbacked": f"{CODE_REWARD} rose by {rise:.2f} while {CODE_PASSED} rose by {backed:.2f}: "
                                       f"the reward pays for something other than passing tests; read the "
                                       f"completions (completions.jsonl) before training further"}
        return {}

    def unbacked_by_eval(self, key: str) -> dict[str, str]:
        """Compare the held-out score's move between the first and the latest eval with the training reward's
        over the same stretch (from the first training logs when the first eval came before any)."""
        if len(self.held_out) < 2:
            return {}
        (first, reward_then), (last, reward_now) = self.held_out[0], self.held_out[-1]
        if reward_then is None:
            reward_then = window_mean(self.history.get("code_reward", []), self.settings.hack_window, last=False)
        if reward_then is None or reward_now is None:
            return {}
        rise, followed = reward_now - reward_then, last - first
        if rise >= self.settings.hack_rise and followed < rise / 2:
            return {"reward_unbacked": f"{CODE_REWARD} rose by {rise:.2f} in training while the held-out {key} "
                                       f"moved by {followed:.2f}: the policy scores on the training prompts without "
                                       f"solving more tasks; read the completions before training further"}
        return {}


def window_mean(values: list[float], window: int, last: bool) -> float | None:
    if not values:
        return None
    chosen = values[-window:] if last else values[:window]
    return sum(chosen) / len(chosen)
