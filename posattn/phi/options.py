"""The checks of the options that several Φp take, each stated once, with errors that name the Φp,
the option, what it means and what was given."""
from __future__ import annotations

from typing import Any, Tuple

from ..grid import TokenGrid, is_integer

__all__ = ['checked_count', 'checked_prefix_tokens', 'checked_pair', 'checked_grid_prefix']


def checked_count(value: Any, phi: str, option: str, minimum: int = 1, meaning: str = '') -> int:
    """``value`` as an int >= ``minimum``, or a ValueError: '<phi> <option> (<meaning>) must be an int
    >= <minimum>, got <value>'."""
    if not is_integer(value) or value < minimum:
        described = f' ({meaning})' if meaning else ''
        raise ValueError(f'{phi} {option}{described} must be an int >= {minimum}, got {value!r}')
    return int(value)


def checked_prefix_tokens(value: Any, phi: str) -> int:
    """The number of extra tokens before the grid a Φp is built for: an int >= 0."""
    return checked_count(value, phi, 'num_prefix_tokens', 0, 'extra tokens before the grid')


def checked_pair(value: Any, phi: str, option: str, meaning: str) -> Tuple[int, int]:
    """``value`` as an (H, W) pair of ints >= 1, or a ValueError saying what the option means."""
    try:
        height, width = value
    except (TypeError, ValueError):
        height = width = None
    if not (is_integer(height) and is_integer(width) and height >= 1 and width >= 1):
        raise ValueError(f'{phi} {option} must be a (height, width) pair of ints >= 1, {meaning}; got {value!r}')
    return int(height), int(width)


def checked_grid_prefix(grid: TokenGrid, num_prefix_tokens: int, phi: str) -> TokenGrid:
    """``grid``, or a ValueError naming the fix where it has another number of prefix tokens than the
    ``num_prefix_tokens`` the Φp ``phi`` was built with."""
    if grid.num_prefix_tokens != num_prefix_tokens:
        raise ValueError(f'{phi} built with num_prefix_tokens={num_prefix_tokens} got a {grid}: build it '
                         f'with num_prefix_tokens={grid.num_prefix_tokens}, the number of extra tokens')
    return grid
