"""ORPO stage: TRL's ORPOTrainer (trl.experimental.orpo) on preference pairs, with no reference model.

    kit run tiny-orpo            (eval -> sft -> eval -> orpo -> eval on the embedded tiny model)

The method (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", arXiv 2403.07691).
A supervised loss on the chosen side plus an odds-ratio penalty, weighted by `beta` (the paper's lambda). With
log-probabilities averaged over each completion's tokens (TRL's `average_log_prob=True`), lp_w for chosen and lp_l
for rejected, and odds(y) = p / (1 - p) for p = exp(lp):

    log odds ratio = (lp_w - lp_l) - (log(1 - exp(lp_w)) - log(1 - exp(lp_l)))
    loss = NLL(chosen) - beta * mean(log sigmoid(log odds ratio))

where TRL 1.15's NLL is the token-mean cross-entropy over every attended token of prompt + chosen (the prompt
included, unlike the paper's completion-only term). No reference: the policy's own odds are compared, so there is no
frozen adapter and no second model (the memory of SFT plus a second sequence per row).

Every field that decides the objective is set by the kit (`--dry-run` prints them; `train:` still wins):

    beta 0.1 (the paper's lambda), learning_rate 5e-6, max_length model.max_seq_length, disable_dropout true

Data: `chosen` / `rejected` with an optional `prompt` (standard or conversational; without `prompt`, TRL extracts
the shared prefix). An eval split (`eval_data`, or `eval_fraction`, default 0.1) logs eval_* figures. Refused before
anything loads, in one line: a reference key (`ref_adapter`, a reference model, `train.precompute_ref_log_probs`),
`beta` <= 0, a pair with an empty chosen or rejected. TRL's metrics go to metrics.jsonl: nll_loss, log_odds_ratio,
log_odds_chosen, rewards/chosen and rewards/rejected (beta * the averaged log-probs), rewards/accuracies,
rewards/margins, logps/*.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Display, Launcher, Memory, Rows, StageSpec
from kitcli.stages import reference_free

TRACKED = (*reference_free.TRACKED, "nll_loss", "log_odds_ratio")


class ORPOSection(reference_free.ReferenceFreeSection):
    """Odds-ratio preference optimization: TRL's ORPOTrainer, SFT and preference in one loss, no reference."""

    type: Literal["orpo"]
    system_prompt: str | None = Field(None, description="A system message put before every prompt (chat data).")
    method: ClassVar[str] = "ORPO"


def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    return {**reference_free.common_defaults(ctx, on_gpu), "beta": 0.1, "padding_value": None}


def make_config(ctx: StageContext):
    return reference_free.make_config(ctx, stage_defaults(ctx))


def describe(ctx: StageContext) -> dict[str, Any]:
    return reference_free.describe(ctx, stage_defaults(ctx))


def build_trainer(ctx: StageContext, config=None):
    """The ORPOTrainer this stage trains with and its loaded policy."""
    return reference_free.build_trainer("orpo", ctx, config or make_config(ctx))


def run(ctx: StageContext) -> dict[str, Any]:
    config = make_config(ctx)
    return reference_free.run("orpo", ctx, config, TRACKED, {"beta": config.beta})


SPEC = StageSpec(
    type="orpo", order=50, module=__name__, section=ORPOSection,
    summary="TRL ORPOTrainer (experimental): NLL on chosen + beta * odds-ratio loss, no reference model",
    output="policy", init_from=("policy",), trainer="trl.experimental.orpo.orpo_trainer:ORPOTrainer",
    config="trl.experimental.orpo.orpo_config:ORPOConfig", rows=Rows(shape="pairs"),
    memory=Memory(settings=("per_device_train_batch_size", "gradient_accumulation_steps", "max_length"),
                  reference="never"),
    refused_keys=reference_free.REFUSED,
    display=Display(
        metrics=(("loss", "loss"), ("nll_loss", "nll"), ("log_odds_ratio", "log-odds"),
                 ("rewards/accuracies", "accuracy"), ("rewards/margins", "margin"), ("learning_rate", "lr")),
        panels=(("loss", "loss", ("loss", "eval_loss")),
                ("NLL on chosen", "nll", ("nll_loss", "eval_nll_loss")),
                ("log sigmoid(log odds ratio)", "log sigmoid", ("log_odds_ratio", "eval_log_odds_ratio")),
                ("reward accuracy", "accuracy", ("rewards/accuracies", "eval_rewards/accuracies")),
                ("average log-probs", "log-prob", ("logps/chosen", "logps/rejected")))),
    launcher=Launcher(refusal="ORPO has not been run under a launcher yet; run it as one process"),
    defaults=stage_defaults)
