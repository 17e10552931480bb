"""Stage prepare: decode a source once into the uint8 cache that every later stage reads.

Reads:  params.yaml (seed, prepare.*); the source: built-in digits, an image folder (or a .zip,
        .tar, .tar.gz of one), or a torchvision root, less the files prepare.exclude names
Writes: <out>/{train,val,test}_{x,y}.npy and _names.json (each image's path; with
        prepare.shard_images, shards of each split: <split>-<key>_{x,y}.npy and _names.json),
        classes.json, stats.json (train-only mean/std), decode.json (how pixels were made),
        manifest.json (sha256 per array, counts, the shards of each split, and what the cache
        was made from: source, split fractions and seed, the mean share of each image that
        prepare.fit kept, and how many files prepare.exclude left out),
        rejects.json (each rejected file and why), duplicates.json (images shared across splits);
        refused (too many rejects): <out>.rejects.json beside it, the full list the error names
Run:    python -m pipeline.prepare --out data/prepared      (or: dvc repro prepare)
"""

import argparse
import shutil
from pathlib import Path

from pipeline import run, staged
from visionflow.data import archive, dataset, pool, sources
from visionflow.data.decode import fit_kept
from visionflow.errors import DataError
from visionflow.params import Params, load_params


def main() -> None:
    parser = argparse.ArgumentParser(description="Decode a source into the uint8 cache.")
    parser.add_argument("--out", type=Path, required=True, help="cache folder to write")
    args = parser.parse_args()
    params = load_params()
    p = params.prepare
    try:
        manifest = build(params, staged(args.out))
    except DataError as e:  # the library names its argument; the key is ours to name
        if e.setting is None:
            raise
        raise DataError(f"prepare.{e.setting}: {e}") from None
    shards = manifest.get("shards", {})  # prepare.shard_images > 0
    sizes = ", ".join(
        f"{s} {sum(c.values())}" + (f" in {len(shards[s])} shards" if shards else "")
        for s, c in manifest["counts"].items()
    )
    print(
        f"prepare: wrote {args.out} ({sizes}; {p.image_size}x{p.image_size} {p.color}); "
        f"{manifest['rejected']} files rejected (rejects.json), {manifest['duplicates']} "
        f"duplicates across splits (duplicates.json)"
    )


def build(params: Params, out: Path) -> dict:
    """Read the source (an archive extracted safely first) and write the cache; its manifest."""
    p = params.prepare
    decode = dataset.Decode(
        p.image_size,
        p.color,
        p.background,
        p.max_pixels,
        p.formats,
        resize=p.interpolation,
        fit=p.fit,
    )
    final = out.name.removesuffix(".partial")  # the output's name (`out` is its staging folder)
    # beside the output, not in the system's temp folder (often a small tmpfs); left by a kill,
    # it goes at the next start (and with the runner's restore)
    tmp = out.with_name(final + ".extract")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        path = Path(p.path)
        if p.source == "imagefolder" and archive.is_archive(path):
            path = archive.extract(path, tmp, p.max_extract_mb * 2**20)
            print(f"prepare: extracted {p.path} safely into {tmp}")
        source = sources.load_source(p.source, path, p.download)
        print(f"prepare: {p.source}: {len(source.labels)} images, {len(source.classes)} classes")
        if p.exclude:  # files a user confirmed mislabelled (sanity's label_issues.json)
            where = p.path if p.source == "imagefolder" else f"the {p.source} images (#i)"
            before = len(source.labels)
            source = sources.exclude(source, p.exclude, where)
            excluded = before - len(source.labels)  # a name listed twice is one file
            print(f"prepare: {excluded} files left out (prepare.exclude)")
        for warning in sources.look_alike_classes(source.classes):
            print(f"prepare: warning: {warning}")
        kept = fit_kept(source.images, p.fit)  # train warns when the crops cut photos
        return dataset.build_cache(
            source,
            out,
            decode,
            val_fraction=p.val_fraction,
            test_fraction=p.test_fraction,
            seed=params.seed,
            workers=p.workers or pool.cores(),  # 0: one per core this process may use
            max_bad_fraction=p.max_bad_fraction,
            min_per_class=p.min_per_class,
            dedupe=p.dedupe,
            shard_images=p.shard_images,
            # not prepare.path: moving the same images must not change the cache (and retrain)
            origin={"source": p.source, "fit_kept": round(kept, 4)}
            | ({"excluded": excluded} if p.exclude else {}),
            refused_report=out.with_name(final + ".rejects.json"),  # kept when refused
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    run(main)
