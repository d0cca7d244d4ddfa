"""Files that are either complete or absent: written beside their final name, then renamed.

A training process can die at any instruction (out of memory, a pre-empted node, SIGKILL).
mmengine's local storage backend writes a checkpoint by truncating the final file and writing
into it, so a death during the write leaves a truncated file under the real name. Here a file is
written to a temporary file in the same folder (:func:`atomic_target`), which is flushed, synced and
renamed over the final name (``os.replace``, atomic on POSIX file systems), and the folder is
synced: the name holds the old complete file or the new complete file, never a part of one.

:class:`~posattn_openmmlab.runner.PosattnRunner` saves its checkpoints this way; mmengine's own
backends, and every other writer in the process, are left as they are. A killed write leaves only
its temporary file, ``.{name}.{pid}.{random}.tmp``, which :func:`remove_partial_writes` deletes
once its writer is gone.
"""
from __future__ import annotations

import os
import re
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Union

__all__ = ['atomic_target', 'atomic_write', 'replace_durably', 'remove_partial_writes', 'process_is_alive']

PathLike = Union[str, os.PathLike]
_PARTIAL = re.compile(r'^\..+\.(\d+)\.[0-9a-f]+\.tmp$')  # .{name}.{pid}.{random hex}.tmp


def replace_durably(source: PathLike, target: PathLike) -> None:
    """Rename the complete file ``source`` over ``target`` (same folder), with the file's data and
    the folder's new entry synced to disk first and last."""
    with open(source, 'rb') as f:
        os.fsync(f.fileno())
    os.replace(source, target)
    descriptor = os.open(os.path.dirname(os.path.abspath(os.fspath(target))), os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def atomic_target(path: PathLike) -> Iterator[str]:
    """A temporary path in ``path``'s folder for the block to write the whole file to; renamed over
    ``path`` (:func:`replace_durably`) when the block ends, deleted when it raises."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f'.{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp')
    try:
        yield temporary
        replace_durably(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def atomic_write(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a synced temporary file in the same folder and a rename."""
    with atomic_target(path) as temporary:
        with open(temporary, 'xb') as f:  # permissions as for any new file (umask), unlike mkstemp's 0600
            f.write(data)


def process_is_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_partial_writes(folder: PathLike) -> List[Path]:
    """Delete the temporary files that killed :func:`atomic_target` writes left in ``folder`` (those
    whose writing process is gone); returns them."""
    removed = []
    for entry in Path(folder).glob('.*.tmp'):
        match = _PARTIAL.match(entry.name)
        if match and entry.is_file() and not process_is_alive(int(match.group(1))):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
