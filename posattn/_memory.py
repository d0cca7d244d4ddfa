"""A clear error before an attention too large for memory starts, not minutes into it."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ['available_bytes', 'check_fits']

# Below this, nothing is checked: reading the free memory costs a system call.
CHECK_ABOVE_BYTES = 1 << 30


def available_bytes(device: torch.device) -> Optional[int]:
    """Memory that a new allocation on ``device`` can still use, or None where it cannot be told:
    for CUDA the driver's free memory plus what PyTorch's allocator holds unused, for the CPU the
    kernel's estimate of available memory (Linux)."""
    if device.type == 'cuda':
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == 'cpu':
        try:
            with open('/proc/meminfo') as f:
                for line in f:
                    if line.startswith('MemAvailable:'):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def _gib(nbytes: int) -> str:
    return f'{nbytes / 2 ** 30:.1f} GiB'


def check_fits(nbytes: int, device: torch.device, what: str, advice: str) -> None:
    """Raise a MemoryError naming ``what`` when ``nbytes`` exceed the memory ``device`` has left."""
    if nbytes < CHECK_ABOVE_BYTES or torch.compiler.is_compiling():
        return
    available = available_bytes(device)
    if available is not None and nbytes > available:
        raise MemoryError(f'{what} needs at least {_gib(nbytes)} on {device}, which has {_gib(available)} '
                          f'available: {advice}')
