"""`model.chat_template`: the chat template every stage, eval, chat, generate and export format turns with.

A recipe names it three ways:
- a name Unsloth's `get_chat_template` knows (`chatml`, `llama-3.1`, `qwen-2.5`, `zephyr`, ...): applied by that
  function, as the notebooks do, so its tokenizer changes come too (for `chatml` and the Gemma templates it renames
  the tokenizer's EOS token to the template's stop word, so the model stops where the template ends a turn);
- a Jinja string (it holds `{%` or `{{`), set as the tokenizer's `chat_template`;
- a file holding one, relative to the recipe's folder (made absolute when the recipe is read).

`resolve_chat_template` checks a recipe's value before anything heavy loads: the names are read from Unsloth's
source with `ast` (as kitcli/recipe/config_fields.py reads TRL's configs: `import unsloth` takes seconds and patches
transformers), and a Jinja template must parse and render a one-turn conversation with a generation prompt.
`apply_chat_template` puts it on a loaded tokenizer (kitcli/models/backend.py `load_policy`, reward models);
`save_model` saves the tokenizer with it, so an adapter, a merged model and a GGUF export carry it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from functools import cache
from pathlib import Path

from kitcli.errors import KitError, did_you_mean

JINJA_MARKS = ("{%", "{{")
SAMPLE_TURN = "What is 2+3?"  # the one-turn conversation a template must render, generation prompt included
SAMPLE_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def is_jinja(value: str) -> bool:
    return any(mark in value for mark in JINJA_MARKS)


def is_template_name(value: str) -> bool:
    return not is_jinja(value) and value in unsloth_templates()


# --- Unsloth's named templates, read from its source -------------------------------------------------------------

def unsloth_source() -> Path | None:
    spec = importlib.util.find_spec("unsloth")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "chat_templates.py"
    return path if path.is_file() else None


@cache
def unsloth_templates() -> dict[str, str]:
    """Each name `unsloth.chat_templates.CHAT_TEMPLATES` holds -> its Jinja text with its default system message
    filled in (what `get_chat_template` sets on a tokenizer that is not Gemma's), read without importing Unsloth.
    Empty where Unsloth is not installed."""
    source = unsloth_source()
    if source is None:
        return {}
    strings: dict[str, str] = {}  # module-level names bound to a string (or a sum of strings)
    found: dict[str, str | None] = {}
    defaults: dict[str, str | None] = {}

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = text(node.left), text(node.right)
            return None if left is None or right is None else left + right
        return strings.get(node.id) if isinstance(node, ast.Name) else None

    def keys(target: ast.AST, table: str, loop: dict[str, list[str]]) -> list[str]:
        if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == table):
            return []
        key = target.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return [key.value]
        return loop.get(key.id, []) if isinstance(key, ast.Name) else []

    def copied(value: ast.AST, table: str, entries: dict[str, str | None]) -> str | None:
        """`TABLE["phi-35"] = TABLE["phi-3"]`: the entry copied."""
        names = keys(value, table, {})
        return entries.get(names[0]) if names else None

    def visit(body: list[ast.stmt], loop: dict[str, list[str]]) -> None:
        for node in body:
            if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple):
                visit(node.body, {node.target.id: [t for t in map(text, node.iter.elts) if t is not None]})
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if isinstance(target, ast.Name) and text(node.value) is not None:
                    strings[target.id] = text(node.value)
                value = node.value
                for name in keys(target, "CHAT_TEMPLATES", loop):
                    found[name] = text(value.elts[0]) if isinstance(value, ast.Tuple) and value.elts else \
                        copied(value, "CHAT_TEMPLATES", found)
                for name in keys(target, "DEFAULT_SYSTEM_MESSAGE", loop):
                    defaults[name] = text(value) if text(value) is not None else \
                        copied(value, "DEFAULT_SYSTEM_MESSAGE", defaults)
    visit(ast.parse(source.read_text(encoding="utf-8")).body, {})
    return {name: with_system_message(template, defaults.get(name)) for name, template in found.items()
            if template is not None}


def with_system_message(template: str, message: str | None) -> str:
    """Unsloth's `_change_system_message` for a named template: its default system message, escaped into the Jinja
    literal that holds the `{system_message}` placeholder."""
    if message is None:
        return template
    escaped = message.replace("\\", "\\\\").replace("'", "\\'").replace('"', '\\"').replace("\r", "\\r")
    return template.replace("{system_message}", escaped)


# --- checking a recipe's value -----------------------------------------------------------------------------------

def template_file(value: str, base_dir: Path) -> Path | None:
    for candidate in (Path(value).expanduser(), base_dir / Path(value).expanduser()):
        if candidate.is_file():
            return candidate.resolve()
    return None


def looks_like_file(value: str) -> bool:
    return "/" in value or "\\" in value or value.startswith((".", "~")) or Path(value).suffix.lower() in (
        ".jinja", ".jinja2", ".j2", ".txt", ".tmpl", ".template")


def resolve_chat_template(value: str, base_dir: Path, backend: str = "auto") -> str:
    """A recipe's `model.chat_template` checked: a Jinja string (returned as it is), a name of Unsloth's (as it is)
    or a file (its absolute path). A KitError says what is wrong, in one line, otherwise."""
    if is_jinja(value):
        check_jinja(value, "the template")
        return value
    if value in unsloth_templates():
        if backend == "transformers":
            raise KitError(f"'{value}' is one of Unsloth's get_chat_template names, and model.backend: transformers "
                           f"loads no Unsloth; give the template's Jinja text (or a file holding it) instead")
        return value
    found = template_file(value, base_dir)
    if found is not None:
        check_jinja(found.read_text(encoding="utf-8"), f"file '{value}'")
        return str(found)
    if looks_like_file(value):
        raise KitError(f"template file '{value}' does not exist (looked relative to {base_dir}); give an existing "
                       f"file holding a Jinja chat template, a Jinja string, or a name of Unsloth's")
    names = sorted(unsloth_templates())
    if not names:
        raise KitError(f"'{value}' is not a Jinja template or an existing file, and the named templates are "
                       f"Unsloth's (get_chat_template), which is not installed; give the template's Jinja text "
                       f"or a file holding it")
    hint = did_you_mean(value, names) or f"; Unsloth's names: {', '.join(names[:12])}, ..."
    raise KitError(f"'{value}' is not a name Unsloth's get_chat_template knows, a Jinja string (with {{% ... %}} "
                   f"or {{{{ ... }}}}) or an existing file{hint}")


def check_jinja(template: str, what: str) -> None:
    """The template parses and renders a one-turn conversation with a generation prompt, holding the turn's text.
    The environment is transformers' (kitcli.models.chat_template.jinja_environment), built without importing it."""
    import jinja2

    if not template.strip():
        raise KitError(f"{what} is empty; give a Jinja chat template")
    try:
        compiled = jinja_environment().from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise KitError(f"{what} does not parse as Jinja (line {error.lineno}: {error.message})") from None
    try:
        rendered = compiled.render(messages=[{"role": "user", "content": SAMPLE_TURN}], add_generation_prompt=True,
                                   **SAMPLE_TOKENS)
    except Exception as error:  # noqa: BLE001  (raise_exception(), an undefined name, a type error: all the user's)
        raise KitError(f"{what} cannot render a one-turn conversation with a generation prompt "
                       f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    if SAMPLE_TURN not in rendered:
        raise KitError(f"{what} renders a one-turn conversation without the turn's text (got {rendered[:80]!r}); "
                       f"does it read message['content']?")


@cache
def jinja_environment():
    """The Jinja environment transformers renders chat templates in (transformers.utils.chat_template_utils
    `_cached_compile_jinja_template`): sandboxed, trim_blocks and lstrip_blocks, loop controls, its `tojson`,
    `raise_exception` and `strftime_now`, and the `{% generation %}` block (rendered as its body)."""
    import json
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda pattern: datetime.now().strftime(pattern)
    return environment


# --- putting it on a tokenizer -----------------------------------------------------------------------------------

def template_text(value: str) -> str:
    """The Jinja text of a checked value, read without Unsloth (for a name: its text as get_chat_template sets it
    on a tokenizer that is not Gemma's, without the EOS renaming: enough to measure lengths, as `kit check` does)."""
    if is_jinja(value):
        return value
    if value in unsloth_templates():
        return unsloth_templates()[value]
    path = Path(value)
    if not path.is_file():
        raise KitError(f"model.chat_template: template file '{value}' does not exist (any more); give an existing "
                       f"file, or set model.chat_template again")
    return path.read_text(encoding="utf-8")


def require_unsloth_for(value: str | None, backend: str, label: str) -> None:
    """Before a model loads: a named template needs Unsloth in this process (an `unsloth-*` backend imports it first,
    in prepare_backend). A process that loads without it (KIT_FORCE_BACKEND=transformers under `kit run --launcher`)
    is refused here, before anything is imported or loaded."""
    if value is not None and is_template_name(value) and not backend.startswith("unsloth") \
            and "unsloth" not in sys.modules:
        raise KitError(f"{label}: model.chat_template '{value}' is applied by Unsloth's get_chat_template, and this "
                       f"process loads models without Unsloth (the transformers backend); give the template's Jinja "
                       f"text (or a file holding it) instead")


def apply_chat_template(tokenizer, value: str | None):
    """`tokenizer` with the recipe's chat template (the same tokenizer, or the new one Unsloth's get_chat_template
    builds when it renames the EOS token). None: the tokenizer's own template, unchanged."""
    if value is None:
        return tokenizer
    if is_template_name(value):
        require_unsloth_for(value, "transformers", "chat template")
        from kitcli import libraries

        with libraries.library_output():  # "Unsloth: Will map <|im_end|> to EOS" goes to libraries.log
            from unsloth.chat_templates import get_chat_template

            return get_chat_template(tokenizer, chat_template=value)
    tokenizer.chat_template = template_text(value)
    return tokenizer


def with_template_text(tokenizer, value: str | None):
    """A copy of `tokenizer` whose template is the recipe's, for reading only (`kit check`'s lengths): the shared,
    cached tokenizer is left as it was, and nothing imports Unsloth."""
    if value is None or tokenizer is None:
        return tokenizer
    import copy

    copied = copy.copy(tokenizer)
    copied.chat_template = template_text(value)
    return copied
