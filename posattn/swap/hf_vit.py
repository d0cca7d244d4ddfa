"""Hugging Face ``transformers`` (>= 5) vision transformers: ViT, DeiT (class and distillation
tokens), DINOv2 (with and without registers), BEiT, Swin, and the vision towers of CLIP and SigLIP.

Each layer's attention holds separate ``q_proj``, ``k_proj``, ``v_proj`` and an output projection
(``o_proj``; CLIP's and SigLIP's ``out_proj``), and runs the attention function that the model's
``config._attn_implementation`` names (eager, sdpa, flash). The swapped layer keeps the four
projections under those names and computes posattn's attention instead, whatever that setting (the
scaled dot product of :class:`posattn.Attention`, with the Φp). The grid comes from the patch
embedding's convolution, so ``interpolate_pos_encoding=True`` and any input size the model accepts
work. A swapped layer returns ``(output, None)``: transformers' ``output_attentions`` cannot collect
what it computes and is refused; ``posattn.analysis.collect_attention_maps`` reads its maps.

BEiT's layers (or, with one shared table, its model) compute the relative position bias from their
tables and hand it to the attention as its ``attention_mask``. While the model's own positions are
kept, the first member of each swapped layer's Φp adds it (:class:`~posattn.swap.given.GivenBias`);
without them it is not applied and the tables are frozen.

Swin attends within windows, each layer with its own relative position table (Swin's layout, kept
under transformers' names) and, in shifted layers, the shift mask given as ``attention_mask``. The
table's bias is the first member of the Φp while kept; ``phi='own'`` hands the table to an ``rpb``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..grid import TokenGrid
from ..phi import PositionalModule
from ..phi.rpb import RelativePositionBias
from .core import AttentionSite, SwapPlan, SwappedAttention, _rename_keys, described, register_family
from .given import GivenBias
from .window_tables import RELATIVE_POSITION_BIAS, WindowTableAttention

__all__ = ['HfAttention', 'HfBeitAttention', 'HfSwinAttention']


class HfAttention(SwappedAttention):
    """Called as a transformers 5 vision layer calls its attention:
    ``attn(hidden_states, attention_mask=None, **kwargs) -> (output, attention weights)``."""

    output_name: str = 'o_proj'  # the model's name of the output projection

    def take_over(self, old: nn.Module) -> None:
        self.qkv = None
        self.proj = None  # the model's output projection serves, under its own name (:attr:`proj`)
        self.output_name = 'o_proj' if hasattr(old, 'o_proj') else 'out_proj'
        self.take(old, 'q_proj', 'k_proj', 'v_proj', self.output_name)
        self.attn_drop.p = float(getattr(old, 'attention_dropout', getattr(old, 'dropout', 0.0)))
        self.config = old.config  # the model's settings, read for output_attentions

    @property
    def proj(self) -> nn.Linear:
        """The model's output projection, which posattn's attention calls ``proj``."""
        return self.get_submodule(self.output_name)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> Tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError('a swapped attention takes no attention mask: the Φp is its positional bias')
        self.refuse_output_attentions(kwargs)
        return self.attention_output(hidden_states), None

    def refuse_output_attentions(self, kwargs: Dict[str, Any]) -> None:
        if kwargs.get('output_attentions', getattr(self.config, 'output_attentions', False)):
            raise ValueError('output_attentions: a swapped attention does not hand its probabilities to '
                             'transformers; posattn.analysis.collect_attention_maps(model, images) reads them')

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, C) -> (B, N, 3 * heads * d), laid out (three, heads, d)."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


class HfBeitAttention(HfAttention):
    """BEiT's attention, whose ``attention_mask`` is the relative position bias (1, heads, N, N) that
    its layer or model computed from the model's tables: offered to the Φp as ``relative_position_bias``."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> Tuple[torch.Tensor, None]:
        self.refuse_output_attentions(kwargs)
        bias = attention_mask if self.reads(RELATIVE_POSITION_BIAS) else None
        return self.attention_output(hidden_states, relative_position_bias=bias), None


class HfSwinAttention(HfAttention):
    """Swin's window attention: (B * windows, N, C) tokens of wh x ww windows, its relative position
    table in ``relative_position_bias`` (transformers' module), and the shift mask (windows, N, N) of a
    shifted layer as ``attention_mask``."""

    def take_over(self, old: nn.Module) -> None:
        super().take_over(old)
        self.window_size = tuple(old.relative_position_bias.window_size)
        table = old.relative_position_bias.relative_position_bias_table
        if any(param is table for param in self.phi.parameters()):  # phi='own': the Φp holds the table
            self.relative_position_bias = None
            holder = next(name for name, param in self.phi.named_parameters() if param is table)
            self.register_load_state_dict_pre_hook(functools.partial(
                _rename_keys, renames={'relative_position_bias.relative_position_bias_table': f'phi.{holder}'}))
        else:
            self.take(old, 'relative_position_bias')

    def current_grid(self, *tensors: Optional[torch.Tensor]) -> TokenGrid:
        """Every window is one wh x ww grid."""
        return TokenGrid(*self.window_size)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> Tuple[torch.Tensor, None]:
        self.refuse_output_attentions(kwargs)
        bias = self.relative_position_bias() if self.reads(RELATIVE_POSITION_BIAS) else None
        shift_mask = WindowTableAttention.shift_mask(hidden_states.shape[0], attention_mask)
        return self.attention_output(hidden_states, attn_mask=shift_mask, relative_position_bias=bias), None


def _swin_own_phi(site: AttentionSite, index: int) -> RelativePositionBias:
    """``phi='own'``: the ``rpb`` holding the layer's table (the same Parameter) for its window."""
    own = site.module.relative_position_bias
    return RelativePositionBias.of_table(own.relative_position_bias_table, tuple(own.window_size), 0)


class _Model(NamedTuple):
    """What the family reads of one transformers vision model class."""
    attention: str  # the class name of its layers' attention
    patch_projection: Callable[[nn.Module], nn.Module]
    num_prefix_tokens: Callable[[nn.Module], int]
    position_embeddings: Callable[[nn.Module], List[nn.Parameter]]
    adapter: type = HfAttention
    relative_tables: Callable[[nn.Module], List[nn.Parameter]] = lambda model: []
    own_phi: Optional[Callable[[AttentionSite, int], PositionalModule]] = None
    windowed: bool = False  # each layer knows its grid (its window): no patch grid to track


def _projection(model: nn.Module) -> nn.Module:
    return model.embeddings.patch_embeddings.projection


def _embedding(model: nn.Module) -> nn.Module:
    return model.embeddings.patch_embedding


def _table(model: nn.Module) -> List[nn.Parameter]:
    return [model.embeddings.position_embeddings]


def _lookup(model: nn.Module) -> List[nn.Parameter]:
    return [model.embeddings.position_embedding.weight]


def _tables(holder: str) -> Callable[[nn.Module], List[nn.Parameter]]:
    """The relative position tables of a model's ``holder`` modules (by class name), in module order."""
    def tables(model: nn.Module) -> List[nn.Parameter]:
        return [module.relative_position_bias_table for module in model.modules() if type(module).__name__ == holder]
    return tables


# transformers' model class name: what the family reads of it
_MODELS: Dict[str, _Model] = {
    'ViTModel': _Model('ViTAttention', _projection, lambda m: 1, _table),
    'DeiTModel': _Model('DeiTAttention', _projection, lambda m: 2, _table),
    'Dinov2Model': _Model('Dinov2Attention', _projection, lambda m: 1, _table),
    'Dinov2WithRegistersModel': _Model('Dinov2WithRegistersAttention', _projection,
                                       lambda m: 1 + m.config.num_register_tokens, _table),
    'CLIPVisionModel': _Model('CLIPAttention', _embedding, lambda m: 1, _lookup),
    'SiglipVisionModel': _Model('SiglipAttention', _embedding, lambda m: 0, _lookup),
    'BeitModel': _Model('BeitAttention', _projection, lambda m: 1, _table, HfBeitAttention,
                        _tables('BeitRelativePositionBias')),
    'SwinModel': _Model('SwinAttention', _projection, lambda m: 0, _table, HfSwinAttention,
                        _tables('SwinRelativePositionBias'), _swin_own_phi, windowed=True),
}


@register_family
def hf_vision_transformer(model: nn.Module) -> Optional[SwapPlan]:
    if not type(model).__module__.startswith('transformers.models.'):
        return None
    found = _MODELS.get(type(model).__name__)
    if found is None:
        return None
    sites = []
    for parent in model.modules():
        for name, attn in parent.named_children():
            if type(attn).__name__ == found.attention:
                sites.append(_site(len(sites), parent, name, attn, found.num_prefix_tokens(model)))
    tables = found.relative_tables(model)
    kept = (lambda site, index: [GivenBias(RELATIVE_POSITION_BIAS)]) if tables else (lambda site, index: [])
    projection = None if found.windowed else found.patch_projection(model)
    return SwapPlan(f'transformers {type(model).__name__}', sites, found.adapter, projection,
                    found.position_embeddings(model), tables, own_phi=found.own_phi, kept_phi=kept)


def _site(index: int, parent: nn.Module, name: str, attn: nn.Module, num_prefix_tokens: int) -> AttentionSite:
    if not hasattr(attn, 'q_proj'):
        raise TypeError(f'layer {index} holds {described(attn)} without q_proj / k_proj / v_proj: the layout of '
                        'transformers < 5, which swap_attention does not read; install transformers >= 5')
    heads = getattr(attn, 'num_attention_heads', None) or attn.num_heads  # per stage in Swin
    width = attn.q_proj.in_features
    if attn.q_proj.out_features != width:
        raise TypeError(f'layer {index} attends in {attn.q_proj.out_features} channels, not the model width {width} '
                        '(head_dim): posattn.Attention splits the width into its heads')
    return AttentionSite(parent, name, width, heads, num_prefix_tokens)
