"""Tools a model calls while it generates (TRL's multi-turn GRPO): plain typed functions with a Google-style
docstring, from which TRL builds each tool's JSON schema. `tools/registry.py` finds them the way rewards are found
(a `kit.tools` entry point, `module:function`, `path/to/file.py:function`), checks them and wraps each so that a
failure becomes a message to the model; `tools/builtin.py` holds calculator, python and search_file.
A library of its own. May import: rewards/ (its sandbox), the ground, and of it only kitcli/errors.py."""
