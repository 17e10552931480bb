"""Write docs/reference.md: every key of params.yaml, from the params models (type, range, default)
and the file's own comments (meaning). `make docs` runs it; tests/test_params.py fails when the
committed page is not what it writes.

    .venv/bin/python docs/make_reference.py [PARAMS] [OUT]
"""

import json
import re
import sys
import types
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from visionflow.params import Params

LINE = re.compile(r"^(?P<indent> *)(?P<key>[\w]+):(?P<value>[^#]*)(#\s*(?P<comment>.*))?$")
BOUNDS = {Ge: ">= {}", Gt: "> {}", Le: "<= {}", Lt: "< {}"}


def comments(params: Path) -> dict[str, str]:
    """`section.key` -> the comment on its line in params.yaml (the file's own words)."""
    found, path = {}, []
    for line in params.read_text().splitlines():
        match = LINE.match(line)
        if not match:
            continue
        depth = len(match["indent"]) // 2
        path = [*path[:depth], match["key"]]
        found[".".join(path)] = (match["comment"] or "").strip()
    return found


def as_yaml(value: object) -> str:
    """A default as params.yaml writes it: false, null, [] (not Python's False, None, ()), and
    1.0e-07, not 1e-07 (which PyYAML, YAML 1.1, reads as a string; DVC and check read both)."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and "e" in repr(value) and "." not in repr(value):
        return repr(value).replace("e", ".0e")
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def kind(annotation) -> str:
    """A field's type in words: its choices, or its Python type."""
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # lr: a number or auto
        return " \\| ".join(kind(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is tuple:
        return "list"
    if typing.get_origin(annotation) is typing.Annotated:
        return kind(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is typing.Union:  # `auto` or a bool
        return " \\| ".join(kind(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))


def rows(model: type[BaseModel], prefix: str, said: dict[str, str]) -> list[str]:
    found = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += rows(annotation, f"{key}.", said)
            continue
        bounds = [
            rule.format(getattr(m, rule_type.__name__.lower()))
            for m in field.metadata
            for rule_type, rule in BOUNDS.items()
            if isinstance(m, rule_type)
        ]
        default = (
            "required" if field.default is PydanticUndefined else f"`{as_yaml(field.default)}`"
        )
        meaning = said.get(key, "").replace("|", "\\|")
        found.append(
            f"| `{key}` | {kind(annotation)} | {', '.join(bounds)} | {default} | {meaning} |"
        )
    return found


def reference(params: Path) -> str:
    lines = [
        "# Parameter reference",
        "",
        "Every key of `params.yaml`, written by `docs/make_reference.py` from the params models",
        "(`src/visionflow/params.py`: type, range, default) and the file's own comments. Keys with a",
        "default may be left out. How the file is checked: [Parameters](parameters.md).",
        "",
        "| key | type | range | default | meaning |",
        "|---|---|---|---|---|",
        *rows(Params, "", comments(params)),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    args = sys.argv[1:]
    params = Path(args[0] if args else "params.yaml")
    out = Path(args[1] if len(args) > 1 else "docs/reference.md")
    out.write_text(reference(params))
    print(f"wrote {out}")
