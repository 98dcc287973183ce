"""Where the offline commands write: checked writable before any model loads (a target takes minutes to load and
the work longer; an unwritable output found at the end loses both), and exported files readable by others."""
from __future__ import annotations

import json
import os
import stat
import tempfile

from .target_loading import CLIError


def _why(path: str, e: OSError) -> str:
    """What stops writing at `path`: an ancestor that is a file (the errno alone says "File exists" or "Not a
    directory", naming neither), else the system's reason."""
    p = os.path.dirname(os.path.abspath(path))
    while p and not os.path.exists(p):
        p = os.path.dirname(p)
    if p and not os.path.isdir(p):
        return f"{p} is a file, not a folder"
    return e.strerror or str(e)


def check_writable_dir(flag: str, path: str) -> None:
    """`path` is (or can be made) a folder a file can be written into; made if absent."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CLIError(f"{flag} {path}: a file; expected a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # os.access says yes to root even on a read-only mount
            pass
    except OSError as e:
        raise CLIError(f"{flag} {path}: cannot write there ({_why(os.path.join(path, 'x'), e)})") from None


def check_writable_file(flag: str, path: str) -> None:
    """`path` can be written (its folder is made if absent; a file this check creates is removed again)."""
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path}: a folder; expected a file path")
    existed = os.path.exists(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise CLIError(f"{flag} {path}: cannot write there ({_why(path, e)})") from None
    if not existed:
        os.remove(path)


def read_record(flag: str, path: str, remedy: str) -> dict:
    """The settings an earlier run recorded in the JSON file `path`; one line naming `flag` and `remedy` if it
    cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CLIError(f"{flag} {path}: unreadable ({e}); {remedy}") from None


def readable_by_all(folder: str) -> None:
    """The files in `folder` get the mode a new file gets under the umask (0644 under the usual 022): safetensors
    writes its file through a private temporary file (0600), and a server or a colleague must read the export."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            os.chmod(path, (stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH)
                     & ~umask)
