"""SimPO stage: TRL's CPOTrainer (trl.experimental.cpo) with `loss_type: simpo` and `cpo_alpha: 0`, on preference
pairs, with no reference model.

    kit run tiny-simpo           (eval -> sft -> eval -> simpo -> eval on the embedded tiny model)

The method (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", arXiv
2405.14734). The implicit reward is the policy's log-probability averaged over the completion's tokens (lp_w for
chosen, lp_l for rejected), scaled by `beta`, and the chosen side must win by a target margin gamma (`simpo_gamma`):

    loss = -mean(log sigmoid(beta * (lp_w - lp_l) - simpo_gamma))

TRL 1.15 writes it as beta * ((lp_w - lp_l) - simpo_gamma / beta), the same value (its `gamma_logratios`); so
`simpo_gamma` is the paper's gamma itself, not the gamma / beta ratio the SimPO repository's configs set. With
`cpo_alpha: 0` CPO's NLL term is off (TRL returns 0 for it), `label_smoothing: 0` and `alpha: 0` (no AlphaPO
transform) keep the plain SimPO loss. No reference: no frozen adapter, no second model.

Every field that decides the objective is set by the kit (`--dry-run` prints them; `train:` still wins):

    loss_type simpo, cpo_alpha 0.0, beta 2.0, simpo_gamma 1.0 (gamma / beta 0.5, the paper's recommended ratio),
    label_smoothing 0.0, alpha 0.0, learning_rate 5e-6, max_length model.max_seq_length, disable_dropout true

`train.cpo_alpha` > 0 adds CPO's NLL on the chosen completion (the SimPO authors' "CPO-SimPO" variant); any other
`loss_type` is not SimPO and is refused. Also refused before anything loads, in one line: a reference key
(`ref_adapter`, a reference model, `train.precompute_ref_log_probs`), `beta` <= 0, `simpo_gamma` < 0 (a negative
target margin rewards a chosen side that loses), `cpo_alpha` < 0, a pair with an empty chosen or rejected.

Data: as DPO's (`chosen` / `rejected`, optional `prompt`, standard or conversational; `eval_data` or
`eval_fraction`, default 0.1). TRL's metrics go to metrics.jsonl: rewards/chosen and rewards/rejected (beta * the
averaged log-probs), rewards/accuracies, rewards/margins, logps/*, nll_loss (0 with cpo_alpha 0).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from kitcli.recipe.config_fields import NOT_NEGATIVE, Range
from kitcli.recipe.schema import fail
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Display, Launcher, Memory, Rows, StageSpec
from kitcli.stages import reference_free

TRACKED = reference_free.TRACKED


class SimPOSection(reference_free.ReferenceFreeSection):
    """Simple preference optimization: TRL's CPOTrainer with the SimPO loss, length-normalised, no reference."""

    type: Literal["simpo"]
    system_prompt: str | None = Field(None, description="A system message put before every prompt (chat data).")
    method: ClassVar[str] = "SimPO"
    train_ranges: ClassVar[dict[str, Range]] = {
        **reference_free.ReferenceFreeSection.train_ranges, "simpo_gamma": NOT_NEGATIVE, "cpo_alpha": NOT_NEGATIVE,
        "label_smoothing": Range(0, False, 0.5, False)}

    @model_validator(mode="after")
    def simpo_loss(self):
        loss = self.train.get("loss_type", "simpo")
        if loss != "simpo":
            raise fail(f"train.loss_type {loss!r} is not SimPO; a simpo stage trains loss_type simpo (remove "
                       f"train.loss_type)")
        return self


def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    return {**reference_free.common_defaults(ctx, on_gpu), "loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0,
            "simpo_gamma": 1.0, "label_smoothing": 0.0, "alpha": 0.0}


def make_config(ctx: StageContext):
    return reference_free.make_config(ctx, stage_defaults(ctx))


def describe(ctx: StageContext) -> dict[str, Any]:
    return reference_free.describe(ctx, stage_defaults(ctx))


def build_trainer(ctx: StageContext, config=None):
    """The CPOTrainer (SimPO loss) this stage trains with and its loaded policy."""
    return reference_free.build_trainer("simpo", ctx, config or make_config(ctx))


def run(ctx: StageContext) -> dict[str, Any]:
    config = make_config(ctx)
    return reference_free.run("simpo", ctx, config, TRACKED,
                              {"beta": config.beta, "simpo_gamma": config.simpo_gamma, "cpo_alpha": config.cpo_alpha})


SPEC = StageSpec(
    type="simpo", order=55, module=__name__, section=SimPOSection,
    summary="TRL CPOTrainer (experimental), loss_type simpo, cpo_alpha 0: length-normalised margin, no reference",
    output="policy", init_from=("policy",), trainer="trl.experimental.cpo.cpo_trainer:CPOTrainer",
    config="trl.experimental.cpo.cpo_config:CPOConfig", rows=Rows(shape="pairs"),
    memory=Memory(settings=("per_device_train_batch_size", "gradient_accumulation_steps", "max_length"),
                  reference="never"),
    refused_keys=reference_free.REFUSED,
    display=Display(
        metrics=(("loss", "loss"), ("rewards/margins", "margin"), ("rewards/accuracies", "accuracy"),
                 ("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"), ("learning_rate", "lr")),
        panels=(("loss", "loss", ("loss", "eval_loss")),
                ("reward margin", "margin", ("rewards/margins", "eval_rewards/margins")),
                ("reward accuracy", "accuracy", ("rewards/accuracies", "eval_rewards/accuracies")),
                ("implicit rewards (beta * average log-prob)", "reward", ("rewards/chosen", "rewards/rejected")))),
    launcher=Launcher(refusal="SimPO has not been run under a launcher yet; run it as one process"),
    defaults=stage_defaults)
