"""kit: single-GPU LoRA post-training recipes (SFT, reward model, DPO, GRPO, GSPO, PPO) on Unsloth and TRL.

A folder per layer, each `__init__.py` saying what it may import (docs/architecture.md draws them). The modules
beside this file are the ground (errors, records, rundir, writer_lock, cache, dist, libraries): they import no folder.
__main__.py, tiny.py and synthetic.py are entry points (`python -m kitcli`, `python -m kitcli.tiny`, `python -m
kitcli.synthetic`).
"""

__version__ = "0.1.0"
