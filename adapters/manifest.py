"""`manifest.json`: sha256 and size of every file of an adapter directory, plus what it is.

Written last when saving and checked first when loading, so a truncated or altered file is
caught before its bytes are parsed.
"""

import hashlib
import json
from pathlib import Path

from inkwell.adapters.errors import ManifestError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, files: list[str], info: dict) -> dict:
    manifest = {
        "format_version": FORMAT_VERSION,
        **info,
        "files": {
            name: {"sha256": sha256_file(directory / name), "size": (directory / name).stat().st_size}
            for name in sorted(files)
        },
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(directory: Path) -> dict:
    """The verified manifest of `directory`; ManifestError names the first bad file."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path}: missing; save adapters with inkwell.adapters.save_adapter", MANIFEST)
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc})", MANIFEST) from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION}; "
            "re-export the adapter with this version of inkwell",
            MANIFEST,
        )
    for name, entry in manifest.get("files", {}).items():
        file = directory / name
        if not file.is_file():
            raise ManifestError(f"{file}: listed in the manifest but missing; copy the whole adapter directory", name)
        size = file.stat().st_size
        if size != entry["size"]:
            raise ManifestError(
                f"{file}: {size} bytes, the manifest says {entry['size']} (truncated or altered); "
                "download the adapter again",
                name,
            )
        if sha256_file(file) != entry["sha256"]:
            raise ManifestError(f"{file}: sha256 does not match the manifest (corrupted); download it again", name)
    return manifest
