"""Safe extraction of `.zip`, `.tar`, `.tar.gz` image folders.

Python 3.11.7 on our machines lacks the 2025 `tarfile` extraction-filter fixes, so no member is
handed to `extractall`: each is checked here (absolute paths, `..`, links, devices, sizes) and
regular files are copied out byte by byte with a cap, so a lying header cannot fill the disk. Any
bad member refuses the whole archive, naming the member, before anything is written.
"""

import shutil
import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

from visionflow.errors import DataError, DiskFull

ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")
MAX_RATIO = 200  # uncompressed / compressed size of one zip member above which it is a bomb


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _safe_name(archive: Path, name: str) -> PurePosixPath:
    """A member name that stays inside the destination, or a DataError naming it."""
    posix = PurePosixPath(name.replace("\\", "/"))
    if (
        posix.is_absolute()
        or name.startswith(("/", "\\"))
        or (posix.parts and ":" in posix.parts[0])
    ):
        raise DataError(f"{archive}: member '{name}' has an absolute path; refusing the archive")
    if ".." in posix.parts:
        raise DataError(f"{archive}: member '{name}' climbs out with '..'; refusing the archive")
    return posix


def _members(archive: Path, max_bytes: int) -> list[tuple[PurePosixPath, object, int]]:
    """(name, handle, size) of each regular file, after checking every member."""
    files, total = [], 0
    if archive.name.lower().endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                name = _safe_name(archive, info.filename)
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise DataError(f"{archive}: member '{info.filename}' is a symlink; refusing")
                if info.is_dir():
                    continue
                if (
                    info.file_size > MAX_RATIO * max(info.compress_size, 1)
                    and info.file_size > 1 << 20
                ):
                    raise DataError(
                        f"{archive}: member '{info.filename}' expands {info.compress_size} "
                        f"to {info.file_size} bytes (zip bomb?); refusing the archive"
                    )
                total += info.file_size
                files.append((name, info, info.file_size))
    else:
        with tarfile.open(archive) as tf:
            for member in tf.getmembers():
                name = _safe_name(archive, member.name)
                if member.issym() or member.islnk():
                    raise DataError(
                        f"{archive}: member '{member.name}' is a link; refusing the archive"
                    )
                if member.isdev() or not (member.isfile() or member.isdir()):
                    raise DataError(
                        f"{archive}: member '{member.name}' is a device or special file; "
                        "refusing the archive"
                    )
                if member.isfile():
                    total += member.size
                    files.append((name, member, member.size))
    if total > max_bytes:
        raise DataError(
            f"{archive}: members add up to {total} bytes, over the limit of {max_bytes} bytes; "
            "refusing the archive",
            setting="max_extract_mb",
        )
    return files


def _copy_capped(src, dst: Path, limit: int, archive: Path, name) -> None:
    copied = 0
    with open(dst, "wb") as out:
        while block := src.read(1 << 20):
            copied += len(block)
            if copied > limit:
                raise DataError(f"{archive}: member '{name}' holds more bytes than its header says")
            out.write(block)


def extract(archive: Path, dest: Path, max_bytes: int) -> Path:
    """Extract an archive of an image folder into `dest`; returns the folder holding the classes.

    An archive whose members all sit under one top folder (`pets/cat/1.jpg`) returns that folder.
    """
    try:
        files = _members(archive, max_bytes)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as error:
        raise DataError(f"{archive}: not a readable archive: {error}") from None
    dest = dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    needed = sum(size for _, _, size in files)
    if needed > shutil.disk_usage(dest).free:
        raise DiskFull.at(dest, needed)
    is_zip = archive.name.lower().endswith(".zip")
    opener = zipfile.ZipFile(archive) if is_zip else tarfile.open(archive)
    with opener as handle:
        for name, member, size in files:
            target = (dest / name).resolve()
            if not target.is_relative_to(dest):  # belt and braces after _safe_name
                raise DataError(f"{archive}: member '{name}' would land outside {dest}")
            target.parent.mkdir(parents=True, exist_ok=True)
            src = handle.open(member) if is_zip else handle.extractfile(member)
            with src:
                _copy_capped(src, target, size, archive, name)
    tops = [p for p in dest.iterdir() if not p.name.startswith(".")]
    if len(tops) == 1 and tops[0].is_dir() and all(p.is_dir() for p in tops[0].iterdir()):
        return tops[0]
    return dest
