"""Write each stage's code deps in dvc.yaml from the import graph (issue #57, item 4): the project
files `python -m pipeline.<stage>` can load (`visionflow.ops.project.stage_modules`), no more, so
a change in a module a stage never runs reruns nothing, and the resume key (`code_digest`, a hash
of the same files) moves only when code the stage runs changes. The other deps (data, params
files, earlier outputs) stay as they are, first; tests/test_dvc_contract.py fails, naming the
files, when dvc.yaml and the imports disagree.

    .venv/bin/python tools/stage_deps.py [--check]
"""

import argparse
import sys
from pathlib import Path

from ruamel.yaml import YAML

from visionflow.ops.project import stage_modules

ROOT = Path(__file__).resolve().parents[1]


def is_code(dep: str) -> bool:
    return dep.startswith(("src/", "pipeline/"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="say what differs; write nothing")
    args = parser.parse_args()
    yaml = YAML()  # round trip: comments and layout kept
    yaml.width = 100
    yaml.indent(mapping=2, sequence=4, offset=2)
    path = ROOT / "dvc.yaml"
    pipeline = yaml.load(path.read_text())
    differ = []
    for stage, spec in pipeline["stages"].items():
        deps = spec.get("deps", [])
        code = stage_modules(ROOT, stage)
        listed = [d for d in deps if is_code(d)]
        if listed == code:
            continue
        missing, extra = sorted(set(code) - set(listed)), sorted(set(listed) - set(code))
        differ.append(f"{stage}: missing {missing or 'none'}; listed, not loaded {extra or 'none'}")
        others = [(d, deps.ca.items.get(i)) for i, d in enumerate(deps) if not is_code(d)]
        deps[:] = [*(d for d, _ in others), *code]
        deps.ca.items.clear()  # the code entries' comments go with them; the others' stay theirs
        deps.ca.items.update({i: said for i, (_, said) in enumerate(others) if said})
    if args.check:
        print("\n".join(differ) or "dvc.yaml: every stage's code deps are its imports")
        sys.exit(1 if differ else 0)
    if differ:
        with path.open("w") as out:
            yaml.dump(pipeline, out)
    print("\n".join(f"dvc.yaml: rewritten: {line}" for line in differ) or "dvc.yaml: as it was")


if __name__ == "__main__":
    main()
