"""PPO for language models (RLHF) as a small library, on accelerate; `kitcli/stages/ppo.py` glues it to a recipe.

    config.py   PPOConfig: the `train:` block of a PPO stage
    models.py   the policy, reference, critic and reward model as adapters on one base, and their forwards
    rollout.py  sampling responses, scoring them, and the Rollout one PPO step learns from
    losses.py   the arithmetic: KL-shaped rewards, GAE, clipped surrogate and value losses (tensors only)
    trainer.py  the loop: PPO steps, the optimizer and the dashboard
    checkpoint.py  resumable checkpoints through accelerate's save_state / load_state

Importing this package (or config.py) loads no torch; the recipe checker reads PPOConfig's fields from its source.

May import: training/, display/, models/, the ground.
"""
