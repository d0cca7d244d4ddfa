"""One training per work_dir: an exclusive ``fcntl.flock`` on ``{work_dir}/train.lock``.

Two trainings writing the same work_dir overwrite each other's checkpoints and ``last_checkpoint``
and mix their logs. :class:`WorkDirLock` makes the second one stop at its start with an error
that names the work_dir and the run holding it (pid, host, start time, command), which the holder
writes into the lock file.

The kernel releases a flock when the process that holds it ends, however it ends (SIGKILL and
out-of-memory kills included), so a killed run leaves nothing stuck: the file stays, describing
its last holder, and the next run takes the lock over. flock needs a file system that supports it
(local disks do; on NFS, Linux emulates it with byte-range locks).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

__all__ = ['WorkDirLock', 'WorkDirInUseError', 'LOCK_FILE']

LOCK_FILE = 'train.lock'


class WorkDirInUseError(RuntimeError):
    """Another training holds the work_dir."""


class WorkDirLock:
    """Context manager holding the work_dir's lock; :meth:`acquire` raises
    :class:`WorkDirInUseError` at once (it does not wait) when another process holds it."""

    def __init__(self, work_dir: str):
        self.work_dir = os.path.abspath(work_dir)
        self.path = os.path.join(self.work_dir, LOCK_FILE)
        self._descriptor: Optional[int] = None

    def acquire(self) -> None:
        os.makedirs(self.work_dir, exist_ok=True)
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 1 << 16).decode(errors='replace')
            os.close(descriptor)
            raise WorkDirInUseError(
                f'{self.work_dir} is in use by another training: {self._describe(holder)}. Let it finish '
                f'or stop it, or give this run another --work-dir.') from None
        holder = dict(pid=os.getpid(), host=socket.gethostname(),
                      started=time.strftime('%Y-%m-%d %H:%M:%S %z'), command=' '.join(sys.argv))
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps(holder).encode(), 0)
        os.fsync(descriptor)
        self._descriptor = descriptor

    def release(self) -> None:
        if self._descriptor is not None:
            fcntl.flock(self._descriptor, fcntl.LOCK_UN)
            os.close(self._descriptor)
            self._descriptor = None

    @staticmethod
    def _describe(holder: str) -> str:
        try:
            info = json.loads(holder)
            return f'pid {info["pid"]} on {info["host"]}, started {info["started"]}: {info["command"]}'
        except (ValueError, KeyError, TypeError):  # the holder has not written its description yet
            return f'a process that has just started (lock file {LOCK_FILE})'

    def __enter__(self) -> 'WorkDirLock':
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
