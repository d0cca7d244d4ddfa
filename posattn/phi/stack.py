"""Several Φp in one attention layer: their hooks combined in a fixed, documented order.

Researchers combine positional schemes: CPVT's PEG with iRPE, RoPE with a bias table, a swapped
model's own scheme with a new one. :class:`PhiStack` holds the members in order and contributes the
union of their declared hooks:

    x    <- tokens_m(x)             for m in order      token hooks in sequence
    q, k <- queries_keys_m(q, k)    for m in order      q/k transforms in sequence
    b     = sum_m logits_bias_m(q, k)                   biases summed (each sees the final q, k)
    A    <- mix_probabilities_m(A)  for m in order      mixtures in sequence (or on the outputs, where
                                                        every mixing member has that form)
    t     = sum_m value_term_m(A)                       value terms summed (each sees the final A)

A list of names builds one: ``Attention(dim, heads, phi=['rope', 'rpb'])``; its state-dict keys
are the members' under their index (``phi.0.*``, ``phi.1.*``). Each member keeps its own caching.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, Optional, Tuple, Union

import torch
from ..grid import TokenGrid
from ..positions import TokenPositions
from .base import PositionalModule

Where = Union[TokenGrid, TokenPositions]

__all__ = ['PhiStack']


class PhiStack(PositionalModule):
    """The Φp ``members`` applied together (module docstring).

    Args:
        members: two or more built Φp, each declaring its hooks; their order is the order of the
            token, query/key and mixture hooks.
    """

    def __init__(self, members: Iterable[PositionalModule]):
        members = list(members)
        if len(members) < 2:
            raise ValueError(f'a Φp stack combines two or more Φp, got {len(members)}: use the Φp itself')
        for index, member in enumerate(members):
            if not isinstance(member, PositionalModule):
                raise TypeError(f'Φp stack member {index} is {type(member).__name__}, not a PositionalModule')
            if isinstance(member, PhiStack):
                raise TypeError(f'Φp stack member {index} is itself a stack: list its members in one stack')
            if any(member is other for other in members[:index]):
                raise ValueError(f'Φp stack member {index} is the same module as an earlier one: build each once')
        hooks = frozenset().union(*(member.declared_hooks() for member in members))
        super().__init__(hooks=hooks, bias_per_image=any(
            member.bias_per_image and member.gives_logits_bias for member in members),
            call_inputs=[name for member in members for name in member.call_inputs],
            reaches_prefix_queries=any(member.reaches_prefix_queries for member in members))
        for index, member in enumerate(members):
            self.add_module(str(index), member)

    @property
    def members(self) -> Tuple[PositionalModule, ...]:
        """The members, in order."""
        return tuple(self.children())

    def _contributing(self, hook: str) -> Iterator[PositionalModule]:
        return (member for member in self.members if member.contributes(hook))

    # Each member gets the call inputs it declared (``given``: the union the stack declares). Every hook
    # serves both forms: ``where`` is a TokenGrid (one grid) or TokenPositions (rows of images), and
    # each member's hook of that form is called (PositionalModule.hook).

    def tokens(self, x: torch.Tensor, grid: TokenGrid, **given: Any) -> torch.Tensor:
        for member in self._contributing('tokens'):
            x = member.tokens(x, grid, **member.given(given))
        return x

    def queries_keys(self, q: torch.Tensor, k: torch.Tensor, where: Where,
                     **given: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        for member in self._contributing('queries_keys'):
            q, k = member.hook('queries_keys', where)(q, k, where, **member.given(given))
        return q, k

    def logits_bias(self, q: torch.Tensor, k: torch.Tensor, where: Where, **given: Any) -> Optional[torch.Tensor]:
        return _sum(member.hook('logits_bias', where)(q, k, where, **member.given(given))
                    for member in self._contributing('logits_bias'))

    def mix_probabilities(self, attn: torch.Tensor, where: Where, key_mask: Optional[torch.Tensor] = None,
                          **given: Any) -> torch.Tensor:
        for member in self._contributing('mix_probabilities'):
            attn = member.hook('mix_probabilities', where)(attn, where, key_mask, **member.given(given))
        return attn

    def mix_outputs(self, out: torch.Tensor, v: torch.Tensor, where: Where, key_mask: Optional[torch.Tensor] = None,
                    **given: Any) -> torch.Tensor:
        for member in self._contributing('mix_probabilities'):  # affine mixtures in sequence, on the outputs
            out = member.hook('mix_outputs', where)(out, v, where, key_mask, **member.given(given))
        return out

    @property
    def mixes_outputs(self) -> bool:
        """Whether every mixing member gives its mixture on the outputs, so that the stack does."""
        mixing = list(self._contributing('mix_probabilities'))
        return bool(mixing) and all(member.mixes_outputs for member in mixing)

    def value_term(self, attn: torch.Tensor, where: Where, **given: Any) -> Optional[torch.Tensor]:
        return _sum(member.hook('value_term', where)(attn, where, **member.given(given))
                    for member in self._contributing('value_term'))

    queries_keys_at, logits_bias_at = queries_keys, logits_bias
    mix_probabilities_at, mix_outputs_at, value_term_at = mix_probabilities, mix_outputs, value_term

    @property
    def runs_on_token_positions(self) -> bool:
        """Whether every member does: the stack then runs a layout in one call."""
        return all(member.runs_on_token_positions for member in self.members)

    def mixture_parts(self, grid: TokenGrid) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The positional attention and share of what the stack mixes in, or None where no member mixes.

        Each mixing member m gives A <- (1 - g_m) A + g_m P_m in order, so the stack gives
        (1 - g) A + g P with 1 - g = prod_m (1 - g_m) and g P = sum_m g_m prod_{n after m} (1 - g_n) P_m:
        folded member by member here, P's rows summing to 1 (P_m's where g = 0)."""
        combined = None
        for parts in (member.mixture_parts(grid) for member in self.members):
            if parts is None:
                continue
            if combined is None:
                combined = parts
                continue
            (position, share), (member_position, member_share) = combined, parts
            total = share + member_share - share * member_share  # (heads,)
            weight = (share * (1 - member_share) / total.masked_fill(total == 0, 1))[:, None, None]
            position = torch.where(total[:, None, None] == 0, member_position,
                                   torch.lerp(member_position, position, weight))
            combined = position, total
        return combined

    @property
    def phi_name(self) -> str:
        return 'stack'

    def settings(self) -> Dict[str, Any]:
        return {'members': tuple(member.phi_name for member in self.members)}  # each member records its own

    def position_inputs(self) -> Tuple[torch.Tensor, ...]:
        return ()  # the members cache their own terms; the stack caches nothing

    def __getitem__(self, index: int) -> PositionalModule:
        return self.members[index]

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[PositionalModule]:
        return iter(self.members)


def _sum(terms: Iterable[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    total = None
    for term in terms:
        if term is not None:
            total = term if total is None else total + term
    return total
