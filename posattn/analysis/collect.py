"""Attention maps and PerViT's measures of every posattn attention layer in a model, read by hooks.

Each :class:`~posattn.Attention` calls its :class:`~posattn.attention.LogitsProbe` with the q, k,
Φp logits bias and grid that its softmax uses; a forward hook there turns them into the three
maps of PerViT's analyses (Sec. 4.1), on the grid positions (extra tokens dropped):

    content  Φc = softmax(q k^T / sqrt(d))
    mixed    Φa = softmax(q k^T / sqrt(d) + b)      what the layer attends with
    position Φp = exp(b)                            sigmoid(z) for peripheral (Eq. 5-8)

b being the Φp's logits bias. A Φp without one (``none``, ``peg``) has no Φp map, and Φa = Φc.
For ``irpe`` Φp = exp(b) is the position term of Appendix D, contextual in ctx mode. A Φp that
mixes a positional attention into the probabilities (``gpsa``, ConViT's gated positional
self-attention) gives its maps as the layer attends with them: Φa is the mixture, Φp its
positional attention and its gate per head (the share of positional attention), both from its
declared :meth:`~posattn.phi.PositionalModule.mixture_parts`. The model's own forward runs unchanged; nothing of it is
copied here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..attention import Attention
from ..functional import attention_probs
from ..grid import TokenGrid
from ..phi import PositionalModule
from .metrics import REGIONS, impact, nonlocality, region_scores, regions_apply

__all__ = ['AttentionMaps', 'LayerMeasures', 'attention_maps', 'collect_attention_maps', 'measure_attention']


@dataclass
class AttentionMaps:
    """The maps of one layer on the grid positions, float32, each (B or 1, heads, P, P), P = H * W;
    ``gate``: the share of positional attention of every head (heads,) where the Φp mixes one into
    the probabilities (``gpsa``), None otherwise."""
    grid: TokenGrid
    content: torch.Tensor
    mixed: torch.Tensor
    position: Optional[torch.Tensor]
    gate: Optional[torch.Tensor] = None


def attention_maps(q: torch.Tensor, k: torch.Tensor, bias: Optional[torch.Tensor], grid: TokenGrid,
                   key_mask: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                   phi: Optional[PositionalModule] = None) -> AttentionMaps:
    """Φc, Φa and Φp (module docstring) from a layer's q, k (B, heads, N, d), logits bias and key mask.

    The probabilities are the layer's (:func:`posattn.functional.attention_probs`), in float32:
    the softmax runs over all N keys, extra tokens included, leaving out the keys ``key_mask``
    (B, N) marks False (padding of windowed attention); the maps are then cut to the grid's
    queries and keys. ``attn_mask``, a mask of the logits that is not positional (Swin's shift
    mask in a swapped Swin), is part of Φa (the layer's softmax uses it) and of neither Φc nor Φp;
    a swapped model's own relative positions, where kept, are a member of the layer's Φp, in b. ``phi``: the layer's Φp; one that mixes the
    probabilities mixes Φa as the layer does and gives Φp and the gate (:func:`_mixed_in_position`).
    """
    q, k = q.float(), k.float()
    bias = None if bias is None else bias.float()
    attn_mask = None if attn_mask is None else attn_mask.float()
    inner = slice(grid.num_prefix_tokens, None)
    content = attention_probs(q, k, None, key_mask)  # (B, heads, N, N)
    logits_bias = bias if attn_mask is None else attn_mask if bias is None else bias + attn_mask  # as the layer sums them
    probs = content if logits_bias is None else attention_probs(q, k, logits_bias, key_mask)
    position, gate = None if bias is None else bias[..., inner, inner].exp(), None
    if phi is not None and phi.mixes_probabilities:
        probs = phi.mix_probabilities(probs, grid, key_mask)
        position, gate = _mixed_in_position(phi, grid)
    content_maps = content[..., inner, inner]
    mixed = content_maps if probs is content else probs[..., inner, inner]
    return AttentionMaps(grid, content_maps, mixed, position, gate)


def _mixed_in_position(phi: PositionalModule, grid: TokenGrid) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Φp (1, heads, P, P) and the gate (heads,), float32, of a Φp that mixes a positional attention into
    the probabilities, from its :meth:`~posattn.phi.PositionalModule.mixture_parts`; None, None where
    it gives none."""
    parts = phi.mixture_parts(grid)
    if parts is None:
        return None, None
    position, gate = parts
    return position[None].detach().float(), gate.detach().float()


def _attention_layers(model: nn.Module) -> Dict[str, Attention]:
    layers = {name: module for name, module in model.named_modules() if isinstance(module, Attention)}
    if not layers:
        raise ValueError(f'{type(model).__name__} has no posattn.Attention layer to analyse; '
                         'build it with posattn or swap its attention in (posattn.swap_attention)')
    return layers


class _Hooks:
    """Calls ``record(layer_name, maps)`` for every layer of ``model`` while in a ``with`` block."""

    def __init__(self, model: nn.Module, record):
        self.layers = _attention_layers(model)
        self.record = record
        self.handles: List[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> '_Hooks':
        for name, layer in self.layers.items():
            def hook(module, args, kwargs, output, name=name, layer=layer):
                self.record(name, attention_maps(*args, **kwargs, phi=layer.phi))
            self.handles.append(layer.logits_probe.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def _run_eval(model: nn.Module, images: torch.Tensor) -> None:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(images)
    finally:
        model.train(was_training)


def collect_attention_maps(model: nn.Module, images: torch.Tensor) -> Dict[str, AttentionMaps]:
    """Φc, Φa, Φp of every posattn attention layer for one batch, in eval mode: {layer name: maps}.

    Holds (B, heads, P, P) maps of every layer: for a few images. :func:`measure_attention` streams.
    """
    maps: Dict[str, AttentionMaps] = {}
    with _Hooks(model, maps.__setitem__):
        _run_eval(model, images)
    return maps


MEASURES = ('nonlocality_position', 'nonlocality_content', 'nonlocality_mixed', 'impact_position',
            'impact_content', 'region_scores')


class LayerMeasures:
    """Per-head measures of one layer (Sec. 4.1), averaged over the samples added so far.

    Attributes (each (heads,) float32, or None where the layer's Φp has no Φp map):
        nonlocality_position / _content / _mixed: Ω of Φp, Φc, Φa (Eq. 13).
        impact_position / _content: Ψp, Ψc (Eq. 12).
        region_scores: (heads, 4) the bracket of Eq. 11 per region; ``regions`` its argmax.
        gate: the share of positional attention of every head, σ(λ) of ``gpsa``, where the Φp
            mixes one into the probabilities; a weight of the layer, as of the latest sample.
    """

    def __init__(self, name: str, grid: TokenGrid):
        self.name, self.grid = name, grid
        self.num_samples = 0
        self._sums: Dict[str, torch.Tensor] = {}
        self.gate: Optional[torch.Tensor] = None

    def add(self, maps: AttentionMaps) -> None:
        if maps.grid != self.grid:
            raise ValueError(f'layer {self.name} saw a {maps.grid} after a {self.grid}: measure one '
                             'input size at a time')
        per_sample = {'nonlocality_content': nonlocality(maps.content, maps.grid),
                      'nonlocality_mixed': nonlocality(maps.mixed, maps.grid),
                      'impact_content': impact(maps.mixed, maps.content)}
        if maps.position is not None:
            position = maps.position.expand_as(maps.mixed)  # batch-free for peripheral
            per_sample.update(nonlocality_position=nonlocality(position, maps.grid),
                              impact_position=impact(maps.mixed, position),
                              region_scores=region_scores(position, maps.grid))
        for key, value in per_sample.items():
            total = value.double().sum(0).cpu()
            self._sums[key] = self._sums[key] + total if key in self._sums else total
        self.num_samples += maps.content.shape[0]
        if maps.gate is not None:
            self.gate = maps.gate.float().cpu()

    def _mean(self, key: str) -> Optional[torch.Tensor]:
        total = self._sums.get(key)
        return None if total is None else (total / self.num_samples).float()

    @property
    def nonlocality_position(self) -> Optional[torch.Tensor]:
        """Ω of Φp per head (Eq. 13); None without a Φp map."""
        return self._mean('nonlocality_position')

    @property
    def nonlocality_content(self) -> Optional[torch.Tensor]:
        """Ω of Φc per head."""
        return self._mean('nonlocality_content')

    @property
    def nonlocality_mixed(self) -> Optional[torch.Tensor]:
        """Ω of Φa per head."""
        return self._mean('nonlocality_mixed')

    @property
    def impact_position(self) -> Optional[torch.Tensor]:
        """Ψp per head (Eq. 12); None without a Φp map."""
        return self._mean('impact_position')

    @property
    def impact_content(self) -> Optional[torch.Tensor]:
        """Ψc per head."""
        return self._mean('impact_content')

    @property
    def region_scores(self) -> Optional[torch.Tensor]:
        """(heads, 4): the bracket of Eq. 11 per region; None without a Φp map."""
        return self._mean('region_scores')

    @property
    def regions(self) -> Optional[List[str]]:
        """Each head's peripheral region (Eq. 11), a name from :data:`~posattn.analysis.metrics.REGIONS`;
        on a grid too small for the regions (:func:`~posattn.analysis.metrics.regions_apply`), that said
        for every head instead."""
        scores = self.region_scores
        if scores is None:
            return None
        if not regions_apply(self.grid):
            return [f'grid too small for regions ({self.grid.height}x{self.grid.width})'] * len(scores)
        return [REGIONS[i] for i in scores.argmax(-1).tolist()]

    def to_dict(self) -> Dict[str, object]:
        """JSON-ready: the layer, its grid, the sample count, every measure as lists, the regions, and
        the gate where the layer has one."""
        out: Dict[str, object] = {'layer': self.name, 'grid': [self.grid.height, self.grid.width],
                                  'num_samples': self.num_samples}
        for key in MEASURES:
            value = getattr(self, key)
            out[key] = None if value is None else value.tolist()
        out['regions'] = self.regions
        out['regions_apply'] = regions_apply(self.grid)
        if self.gate is not None:
            out['gate'] = self.gate.tolist()
        return out


def measure_attention(model: nn.Module, batches: Iterable[torch.Tensor]) -> List[LayerMeasures]:
    """Ω, Ψ and peripheral regions of every posattn attention layer, per head, averaged over all
    images of ``batches`` (eval mode, no gradients); layers in the model's order.

    Only the running sums are kept, so any number of images fits in memory.
    """
    measures: Dict[str, LayerMeasures] = {}

    def record(name: str, maps: AttentionMaps) -> None:
        if name not in measures:
            measures[name] = LayerMeasures(name, maps.grid)
        measures[name].add(maps)

    hooks = _Hooks(model, record)
    with hooks:
        for images in batches:
            _run_eval(model, images)
    if not measures:
        raise ValueError('no images to measure: the batches were empty')
    return [measures[name] for name in hooks.layers if name in measures]
