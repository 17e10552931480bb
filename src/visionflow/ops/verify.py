"""`visionflow verify`: re-hash the prepared cache and the DVC cache objects the pipeline uses.

The prepared files (arrays, classes, statistics, preprocessing) are checked against the sha256 in
prepare's manifest.json; every object that
dvc.lock's outs point at (directories through their `.dir` listing) is re-hashed with md5, the
hash DVC names it by. Outs declared `cache: false` have no object and are skipped.
"""

import json
from pathlib import Path

import yaml

from visionflow.data.files import file_hash, verify_cache
from visionflow.errors import DataError


def uncached_outs(root: Path) -> set[str]:
    stages = yaml.safe_load((root / "dvc.yaml").read_text()).get("stages", {})
    return {
        path
        for stage in stages.values()
        for out in stage.get("outs", [])
        if isinstance(out, dict)
        for path, flags in out.items()
        if (flags or {}).get("cache") is False
    }


def dvc_objects(root: Path) -> tuple[int, list[str]]:
    """(objects checked, problems): each problem names the out, the object and both hashes."""
    from dvc.repo import Repo  # imported here: `verify` of the prepared cache alone needs no DVC

    lock_path = root / "dvc.lock"
    if not lock_path.exists():
        return 0, []
    objects = Repo(str(root)).cache.local
    skip = uncached_outs(root)
    checked, problems = 0, []

    def check(label: str, oid: str) -> bool:
        nonlocal checked
        path = Path(objects.oid_to_path(oid))
        checked += 1
        if not path.exists():
            problems.append(f"{label}: object {path} is missing (`dvc repro` or `dvc pull`)")
            return False
        actual = file_hash(path, "md5")  # the hash DVC names objects by
        if actual != oid.removesuffix(".dir"):
            problems.append(f"{label}: object {path} has md5 {actual}, dvc.lock says {oid}")
            return False
        return True

    for stage in yaml.safe_load(lock_path.read_text()).get("stages", {}).values():
        for out in stage.get("outs", []):
            if out["path"] in skip or "md5" not in out:
                continue
            oid = out["md5"]
            if check(out["path"], oid) and oid.endswith(".dir"):
                listing = json.loads(Path(objects.oid_to_path(oid)).read_text())
                for entry in listing:
                    check(f"{out['path']}/{entry['relpath']}", entry["md5"])
    return checked, problems


def verify(root: Path, cache: Path) -> int:
    """Print what was checked and any problem; 1 when something is bad, else 0."""
    problems, arrays = [], 0
    try:  # a missing manifest, or a missing cache, is a problem too, not "all good"
        arrays = len(verify_cache(cache))
    except DataError as e:
        problems.append(str(e))
    checked, bad_objects = dvc_objects(root)
    problems += bad_objects
    for problem in problems:
        print(f"BAD  {problem}")
    summary = f"{len(problems)} problem(s)" if problems else "all good"
    print(f"verify: {arrays} prepared files in {cache}, {checked} DVC cache objects: {summary}")
    return 1 if problems else 0
