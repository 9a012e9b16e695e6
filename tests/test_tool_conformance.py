"""Conformance of multi-turn tool training (issue 28, item 7), on TRL's GRPOTrainer and on Unsloth's generated one
(conftest.trainer_family): on a fixed tool-calling conversation with the tiny model, tool-result tokens carry no
loss and no KL, and the reference log-probs are taken on the same multi-turn sequence as the policy's.

The policy's replies are scripted (the tiny model does not call tools by itself): the trainer's generation step
(`_generate_single_turn`) returns fixed token ids chosen by the conversation so far. Everything after it is the
trainer's own code: parsing the replies, calling the kit's guarded tool, appending the tool turns, building
`tool_mask`, padding, the reference forward and the loss. What it builds is compared with an independent
computation from the chat template alone: each assistant reply is what the model emits (up to and including
`<|im_end|>`, mask 1), and whatever the template renders between one reply and the next (the tool turns and the
next assistant header) is not the model's (mask 0).

- the completion the trainer trains on is the rendered conversation, token for token, and its loss mask is the
  independent one;
- a backward pass through the trainer's own `compute_loss` puts gradient on exactly the positions that predict model
  tokens, with the policy at the reference and advantages set (the policy-gradient term), and with the policy moved
  away from the reference and zero advantages (the KL term); the gradient is read at the last decoder layer's output,
  which reaches no other position;
- the reference forward (the frozen 'ref' adapter) ran on each row's whole multi-turn sequence, and its log-probs
  equal those of the starting policy (a fresh adapter: the base model) on the independently built sequence.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import stage_context, write_recipe

pytestmark = pytest.mark.slow

TOOL = '''
def f(x: str) -> str:
    """F.

    Args:
        x: X.
    """
    if x == "0":
        raise RuntimeError("zero")
    return x + "7"
'''


def call(*xs: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"x": x}}} for x in xs]}


def result(content: str) -> dict:
    return {"role": "tool", "name": "f", "content": content}


def answer(content: str) -> dict:
    return {"role": "assistant", "content": content}


QUESTIONS = {"q1": "17", "q2": "27"}
# The batch: 2 prompts x 2 generations, in the trainer's order. Two rounds of calls; two calls in one reply, the
# first failing (the guarded tool's message reaches the model); no call; one call.
CONVERSATIONS = [
    ("q1", [call("1"), result("17"), call("17"), result("177"), answer("177")]),
    ("q1", [call("0", "1"), result("{'error': 'f failed: RuntimeError: zero'}"), result("17"), answer("17")]),
    ("q2", [answer("27")]),
    ("q2", [call("2"), result("27"), answer("27")]),
]


def expected_completion(tokenizer, tools: list, prompt: list[dict], turns: list[dict]) -> dict:
    """The completion of one conversation from the chat template alone: its text, token ids, loss mask (1 on what
    the model emitted, 0 on the rest) and each assistant reply's (start, end) in the ids."""
    def render(messages, generation_prompt):
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                             tokenize=False)

    def tokens(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    head = render(prompt, True)
    done = head  # rendered text covered so far
    ids, mask, replies = [], [], []
    for k, turn in enumerate(turns):
        ends_run = k + 1 == len(turns) or turns[k + 1]["role"] != turn["role"]
        if turn["role"] == "tool" and not ends_run:
            continue  # a run of tool turns is one piece: up to the next assistant header
        rendered = render(prompt + turns[:k + 1], turn["role"] == "tool")
        assert rendered.startswith(done), "the template does not keep prefixes"
        piece = rendered[len(done):]
        if turn["role"] == "assistant":  # the model stops at its end-of-turn token; the newline after is the template's
            piece = piece[:piece.index("<|im_end|>") + len("<|im_end|>")]
        new = tokens(piece)
        if turn["role"] == "assistant":
            replies.append((len(ids), len(ids) + len(new)))
        ids += new
        mask += [1 if turn["role"] == "assistant" else 0] * len(new)
        done += piece
    return {"text": done[len(head):], "ids": ids, "mask": mask, "replies": replies}


class Recorder:
    """Forward hooks on the policy (no change to what it computes): the input ids of every forward of the decoder,
    whether it ran as the reference (TRL's frozen 'ref' adapter active, or the adapters off), and the last decoder
    layer's output, its gradient kept."""

    def __init__(self, model):
        from peft.tuners.lora import LoraLayer

        base = model.get_base_model()
        self.lora = next(m for m in model.modules() if isinstance(m, LoraLayer))
        self.forwards: list[dict] = []
        self.handles = [base.model.register_forward_pre_hook(self.before, with_kwargs=True),
                        base.model.layers[-1].register_forward_hook(self.after)]

    def before(self, module, args, kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        reference = self.lora.disable_adapters or list(self.lora.active_adapters) == ["ref"]  # TRL's use_adapter
        self.forwards.append({"ids": ids.detach().clone(), "reference": reference})

    def after(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.retain_grad()
        self.forwards[-1]["hidden"] = hidden


def locate(ids: torch.Tensor, sequence: list[int]) -> tuple[int, int] | None:
    """(row, start) of `sequence` inside a forward's input ids (padded rows, or Unsloth's packed single row)."""
    for row, values in enumerate(ids.tolist()):
        for start in range(len(values) - len(sequence) + 1):
            if values[start:start + len(sequence)] == sequence:
                return row, start
    return None


@pytest.fixture
def scored(trainer_family, tmp_path):
    """The trainer of a GRPO stage with the tool `f` (beta 0.04, so a reference forward runs), its scored batch of
    the four fixed conversations, the expected completions and the recorder."""
    from transformers.utils import get_json_schema

    from kitcli.stages import grpo as grpo_stage
    from kitcli.training.trainers import is_unsloth_class

    (tmp_path / "t.py").write_text(TOOL)
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in QUESTIONS.items()]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    stage = {"name": "grpo", "type": "grpo", "data": str(tmp_path / "q.jsonl"), "rewards": ["exact_match"],
             "tools": ["t.py:f"], "train": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 2,
                                            "max_completion_length": 256, "beta": 0.04}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage], model={"name": "tiny", "max_seq_length": 512,
                                                               "dtype": "float32"})
    trainer, _, _ = grpo_stage.build_trainer(stage_context(recipe, "grpo", tmp_path / "run"),
                                             grpo_stage.VARIANTS["grpo"])
    assert is_unsloth_class(type(trainer)) == (trainer_family == "unsloth")
    tokenizer = trainer.processing_class
    schemas = [get_json_schema(tool) for tool in trainer.tools]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tools=schemas,
                                             add_generation_prompt=True, return_dict=False) for q, _ in CONVERSATIONS]
    expected = [expected_completion(tokenizer, schemas, [{"role": "user", "content": q}], turns)
                for q, turns in CONVERSATIONS]

    def scripted_policy(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """The next reply of each conversation, found by its whole context (prompt + completion so far)."""
        replies = []
        for n, context in enumerate(prompt_ids):
            candidates = [n] if list(context) == prompts[n] else range(len(CONVERSATIONS))  # first round: row n
            found = [expected[i]["ids"][start:end] for i in candidates for start, end in expected[i]["replies"]
                     if list(context) == prompts[i] + expected[i]["ids"][:start]]
            assert len(found) == 1, f"no scripted reply for the context {tokenizer.decode(context[-60:])!r}"
            replies.append(found[0])
        return replies, None

    trainer._generate_single_turn = scripted_policy
    recorder = Recorder(trainer.model)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([trainer.train_dataset[i // 2] for i in range(4)])
    assert [trainer.train_dataset[i // 2]["prompt"][0]["content"] for i in range(4)] == [q for q, _ in CONVERSATIONS]
    return {"trainer": trainer, "batch": batch, "expected": expected, "prompts": prompts, "recorder": recorder}


def test_the_loss_mask_leaves_out_exactly_the_tool_turns(scored):
    batch, tokenizer = scored["batch"], scored["trainer"].processing_class
    loss_mask = batch["completion_mask"] * batch["tool_mask"]
    for i, expected in enumerate(scored["expected"]):
        n = int(batch["completion_mask"][i].sum())
        assert batch["completion_ids"][i, :n].tolist() == expected["ids"], i
        assert tokenizer.decode(batch["completion_ids"][i, :n]) == expected["text"], i
        assert loss_mask[i, :n].tolist() == expected["mask"], i
        assert not loss_mask[i, n:].any()
    assert sum(e["mask"].count(0) for e in scored["expected"]) > 60  # tool turns are really there
    metrics = scored["trainer"]._metrics["train"]
    assert metrics["tools/call_frequency"] == [5 / 4] and metrics["tools/failure_frequency"] == [pytest.approx(1 / 5)]


def gradient_on_predictions(scored, advantages: list[float]) -> list[list[int]]:
    """A backward pass through the trainer's compute_loss on the scored batch: per row, 1 where the hidden state that
    predicts a completion token got gradient, 0 where it got none."""
    trainer, batch, recorder = scored["trainer"], dict(scored["batch"]), scored["recorder"]
    batch["advantages"] = torch.tensor(advantages)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this bypasses
    recorder.forwards.clear()
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, batch).backward()
    graded = [f for f in recorder.forwards if "hidden" in f and f["hidden"].grad is not None]
    assert graded, "no forward of compute_loss carried gradient"
    pattern = []
    for i, expected in enumerate(scored["expected"]):
        sequence = scored["prompts"][i] + expected["ids"]
        forward, (row, start) = next((f, where) for f in graded if (where := locate(f["ids"], sequence)))
        norms = forward["hidden"].grad[row].norm(dim=-1)
        first = start + len(scored["prompts"][i]) - 1  # the position that predicts the first completion token
        pattern.append([int(norms[first + j] > 0) for j in range(len(expected["ids"]))])
    return pattern


def test_tool_tokens_carry_no_loss_and_no_kl(scored):
    expected = [e["mask"] for e in scored["expected"]]
    # the policy is still the reference (a fresh LoRA adapter): the KL term has no gradient, the advantages do
    assert gradient_on_predictions(scored, [1.0, -1.0, 0.5, -0.5]) == expected
    # Move the policy away from the reference, a little: Unsloth's loss caps each token's KL at 10 (TRL's does not),
    # and a capped token gets no KL gradient (0.05 or 0.01 here moved a token by 3-5 nats, a KL over 10, and hid it).
    with torch.no_grad():  # zero advantages then leave the KL term alone
        for name, param in scored["trainer"].model.named_parameters():
            if "lora_B" in name:
                param.add_(0.002 * torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
    assert gradient_on_predictions(scored, [0.0, 0.0, 0.0, 0.0]) == expected


def test_reference_log_probs_are_taken_on_the_multi_turn_sequence(scored):
    trainer, batch = scored["trainer"], scored["batch"]
    reference = [f for f in scored["recorder"].forwards if f["reference"]]
    assert reference, "no reference forward ran"
    model = trainer.model
    for i, expected in enumerate(scored["expected"]):
        sequence = scored["prompts"][i] + expected["ids"]
        assert any(locate(f["ids"], sequence) for f in reference), f"row {i}: the reference saw another sequence"
        with torch.no_grad(), model.disable_adapter():
            logits = model(input_ids=torch.tensor([sequence])).logits[0].float()
        logps = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
        independent = logps[len(scored["prompts"][i]) - 1:]
        n = len(expected["ids"])
        assert torch.allclose(batch["ref_per_token_logps"][i, :n].float(), independent, atol=1e-4), i

