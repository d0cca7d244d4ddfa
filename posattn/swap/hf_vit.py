"""Hugging Face ``transformers`` (>= 5) vision transformers: ViT, DeiT (class and distillation
tokens), ViT-MSN, I-JEPA, Pixio (several class tokens), DINOv2 (with and without registers), BEiT
and Data2VecVision, Swin, and the vision towers of CLIP, Chinese-CLIP, SigLIP, SigLIP 2 and AIMv2.

Each layer's attention holds separate ``q_proj``, ``k_proj``, ``v_proj`` and an output projection
(``o_proj``; CLIP's and SigLIP's ``out_proj``), and runs the attention function that the model's
``config._attn_implementation`` names (eager, sdpa, flash). The swapped layer keeps the four
projections under those names and computes posattn's attention instead, whatever that setting (the
scaled dot product of :class:`posattn.Attention`, with the Φp). The grid comes from the patch
embedding's convolution, so ``interpolate_pos_encoding=True`` and any input size the model accepts
work. SigLIP 2 (NaFlex) takes the patches of images of different grids, padded to one length:
each image attends within its own grid (``spatial_shapes``), and the model's padding mask is
checked against them. A swapped layer returns ``(output, None)``: transformers' ``output_attentions``
cannot collect what it computes and is refused; ``posattn.analysis.collect_attention_maps`` reads
its maps.

BEiT's layers (or, with one shared table, its model) compute the relative position bias from their
tables and hand it to the attention as its ``attention_mask``. While the model's own positions are
kept, the first member of each swapped layer's Φp adds it (:class:`~posattn.swap.given.GivenBias`);
without them it is not applied and the tables are frozen. ``phi='own'`` hands each layer's table to
an ``rpb`` (exact at the grid the tables were learned for; at another, ``rpb`` resamples its table
as posattn does, not as transformers interpolates BEiT's bias).

Swin attends within windows, each layer with its own relative position table (Swin's layout, kept
under transformers' names) and, in shifted layers, the shift mask given as ``attention_mask``. The
table's bias is the first member of the Φp while kept; ``phi='own'`` hands the table to an ``rpb``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..grid import TokenGrid
from ..layout import ImageLayout
from ..phi import PositionalModule
from ..phi.rpb import RelativePositionBias
from .core import (AttentionSite, GridSource, OwnScheme, SwapPlan, SwappedAttention, check_padding_mask, described,
                   hand_held_modules_to_phi, imported, register_family, register_refusal)
from .given import GivenBias
from .token_grids import PatchGrid
from .window_tables import RELATIVE_POSITION_BIAS, WindowTableAttention

__all__ = ['HfAttention', 'HfNaFlexAttention', 'HfBeitAttention', 'HfData2VecAttention', 'HfSwinAttention']


class HfAttention(SwappedAttention):
    """Called as a transformers 5 vision layer calls its attention:
    ``attn(hidden_states, attention_mask=None, **kwargs) -> (output, attention weights)``."""

    output_name: str = 'o_proj'  # the model's name of the output projection

    def take_over(self, old: nn.Module) -> None:
        self.qkv = None
        del self.proj  # the model's output projection serves, under its own name (:meth:`output_projection`)
        self.output_name = 'o_proj' if hasattr(old, 'o_proj') else 'out_proj'
        self.take(old, 'q_proj', 'k_proj', 'v_proj', self.output_name)
        self.attn_drop.p = float(getattr(old, 'attention_dropout', getattr(old, 'dropout', 0.0)))
        self.config = old.config  # the model's settings, read for output_attentions

    def output_projection(self) -> nn.Module:
        """The model's output projection, under the model's name."""
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


class HfNaFlexAttention(HfAttention):
    """SigLIP 2's attention, on a NaFlex batch: each image attends within its own grid, and the
    ``attention_mask`` the model gives is its padding mask, checked against the batch's layout."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> Tuple[torch.Tensor, None]:
        self.refuse_output_attentions(kwargs)
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise ValueError(f'a swapped SigLIP 2 reads its padding mask as a tensor, got a '
                                 f'{type(attention_mask).__name__}: use attn_implementation "eager" or "sdpa"')
            check_padding_mask(attention_mask, self.current_grid(hidden_states))
        return self.attention_output(hidden_states), None


def siglip2_grid(embeddings: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 output: torch.Tensor) -> ImageLayout:
    """The layout of a SigLIP 2 batch, from its embeddings' call: each image's ``spatial_shapes``
    (height, width) grid, its patches first in its row, padding after."""
    shapes = dict(zip(('pixel_values', 'spatial_shapes'), args), **kwargs)['spatial_shapes']
    grids = [tuple(shape) for shape in torch.as_tensor(shapes).tolist()]
    return ImageLayout.padded(grids, length=output.shape[1])


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
        self.take(old, 'relative_position_bias')  # phi='own': the Φp holds its table, and the swap detaches it

    def current_grid(self, *tensors: Optional[torch.Tensor]) -> TokenGrid:
        """Every window is one wh x ww grid."""
        return TokenGrid(*self.window_size)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> Tuple[torch.Tensor, None]:
        self.refuse_output_attentions(kwargs)
        bias = self.relative_position_bias() if self.reads(RELATIVE_POSITION_BIAS) else None
        shift_mask = WindowTableAttention.shift_mask(hidden_states.shape[0], attention_mask)
        return self.attention_output(hidden_states, attn_mask=shift_mask, relative_position_bias=bias), None


class HfData2VecAttention(HfAttention):
    """Data2VecVision's attention in the layout transformers 4 had: ``attention`` (``query``, ``key``,
    ``value``, and the layer's own ``relative_position_bias`` table) and ``output`` (``dense`` and its
    dropout), kept under those names; called as ``attn(hidden_states, output_attentions=False,
    relative_position_bias=None, interpolate_pos_encoding=False, resolution=None)`` with the model's
    shared bias, if any, as ``relative_position_bias``; returns ``(output,)``."""

    output_name = 'output.dense'

    def take_over(self, old: nn.Module) -> None:
        self.qkv = None
        del self.proj  # output.dense serves (:meth:`output_projection`)
        self.take(old, 'attention', 'output')
        self.attn_drop.p, self.proj_drop.p = old.attention.dropout.p, old.output.dropout.p
        self.config = old.attention.config  # phi='own': the Φp holds the table, and the swap detaches its module

    def forward(self, hidden_states: torch.Tensor, output_attentions: bool = False,
                relative_position_bias: Optional[torch.Tensor] = None, interpolate_pos_encoding: bool = False,
                resolution: Optional[Tuple[int, int]] = None) -> Tuple[torch.Tensor]:
        self.refuse_output_attentions(dict(output_attentions=output_attentions))
        bias = None
        if self.reads(RELATIVE_POSITION_BIAS):  # the layer's table's bias, computed as the model does, + the shared
            own = getattr(self.attention, 'relative_position_bias', None)
            if own is not None:
                window = (resolution[0] // self.config.patch_size, resolution[1] // self.config.patch_size)
                bias = own(window, interpolate_pos_encoding, dim_size=hidden_states.shape[1])
            if relative_position_bias is not None:
                bias = relative_position_bias if bias is None else bias + relative_position_bias
        return (self.attention_output(hidden_states, relative_position_bias=bias),)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.attention.query(x), self.attention.key(x), self.attention.value(x)], dim=-1)


def _swin_own_phi(site: AttentionSite, index: int) -> RelativePositionBias:
    """``phi='own'``: the ``rpb`` holding the layer's table (the same Parameter) for its window."""
    own = site.module.relative_position_bias
    return RelativePositionBias.of_table(own.relative_position_bias_table, tuple(own.window_size), 0)


@dataclass(frozen=True, kw_only=True)
class HfFamily:
    """What the family reads of the base model (``model.base_model``) of one transformers model type.

    Attributes:
        attention: the class name of its layers' attention.
        num_prefix_tokens: ``num_prefix_tokens(base)``, the tokens before the patch grid.
        absolute: ``absolute(base)``, its absolute position embeddings (:attr:`OwnScheme.absolute`).
        grid_module: ``grid_module(base)``, the module whose call gives the token grid
            (:attr:`GridSource.module`); None where each layer knows its grid (its window).
        read_grid: :attr:`GridSource.read`, where that module's output is no (B, C, H, W).
        adapter: the swapped layer's class.
        relative: ``relative(base)``, its relative position tables, kept first in each layer's Φp.
        converted: ``converted(base)``, the :attr:`OwnScheme.converted` of ``phi='own'``, or None where
            the model has no relative scheme.
        installed: :attr:`OwnScheme.installed`.
        fixed: ``fixed(base)``, :attr:`OwnScheme.fixed`.
    """
    attention: str
    num_prefix_tokens: Callable[[nn.Module], int]
    absolute: Callable[[nn.Module], List[nn.Parameter]]
    grid_module: Optional[Callable[[nn.Module], nn.Module]]
    read_grid: Optional[PatchGrid] = None
    adapter: type = HfAttention
    relative: Callable[[nn.Module], List[nn.Parameter]] = lambda base: []
    converted: Callable[[nn.Module], Optional[Callable[[AttentionSite, int], PositionalModule]]] = lambda base: None
    installed: Optional[Callable[[AttentionSite, SwappedAttention], None]] = None
    fixed: Callable[[nn.Module], Optional[str]] = lambda base: None


def _projection(model: nn.Module) -> nn.Module:
    return model.embeddings.patch_embeddings.projection


def _embedding(model: nn.Module) -> nn.Module:
    return model.embeddings.patch_embedding


def _aimv2_embedding(model: nn.Module) -> List[nn.Parameter]:
    """AIMv2's learned position embedding; none in its native variant (``is_native``)."""
    embedding = getattr(model.embeddings, 'position_embedding', None)
    return [] if embedding is None else [embedding.weight]


def _aimv2_fixed(model: nn.Module) -> Optional[str]:
    if model.config.is_native:
        return 'its native variant (is_native) adds a 2D sinusoidal embedding computed in its forward'
    return None


def _table(model: nn.Module) -> List[nn.Parameter]:
    return [model.embeddings.position_embeddings]


def _lookup(model: nn.Module) -> List[nn.Parameter]:
    return [model.embeddings.position_embedding.weight]


def _tables(holder: str) -> Callable[[nn.Module], List[nn.Parameter]]:
    """The relative position tables of a model's ``holder`` modules (by class name), in module order."""
    def tables(model: nn.Module) -> List[nn.Parameter]:
        return [module.relative_position_bias_table for module in model.modules() if type(module).__name__ == holder]
    return tables


def _beit_own_phi(model: nn.Module) -> Optional[Callable[[AttentionSite, int], PositionalModule]]:
    """``phi='own'`` for a BEiT: each layer's table (in the layer around the attention)."""
    return _table_own_phi(model.shared_position_bias is not None, _tables('BeitRelativePositionBias')(model),
                          lambda site: site.parent.relative_position_bias)


def _data2vec_own_phi(model: nn.Module) -> Optional[Callable[[AttentionSite, int], PositionalModule]]:
    """``phi='own'`` for a Data2VecVision: each layer's table (in its self-attention)."""
    return _table_own_phi(bool(model.encoder.has_relative_position_bias),
                          _tables('Data2VecVisionRelativePositionBias')(model), lambda site: getattr(site.module.attention, 'relative_position_bias', None))


def _table_own_phi(shared: bool, tables: List[nn.Parameter], own_of: Callable[[AttentionSite], Optional[nn.Module]]
                   ) -> Optional[Callable[[AttentionSite, int], PositionalModule]]:
    """BEiT's scheme for ``phi='own'``: each layer's table (``own_of(site)``) as an ``rpb`` (the same
    Parameter, BEiT's three class-token rows included), or, with the model's one ``shared`` table, the
    bias the model gives each layer (:class:`~posattn.swap.given.GivenBias`); None without a table."""
    if not tables:
        return None

    def own_phi(site: AttentionSite, index: int) -> PositionalModule:
        own = own_of(site)
        if own is None:
            return GivenBias(RELATIVE_POSITION_BIAS)
        if shared:
            raise TypeError(f"phi='own' converts BEiT's relative position tables into one rpb per layer, but layer "
                            f'{index} adds its own table to the shared one: pick a Φp by name (\'none\' keeps both)')
        return RelativePositionBias.of_table(own.relative_position_bias_table, tuple(own.window_size), 1)
    return own_phi


def _hand_beit_table_to_phi(site: AttentionSite, layer: SwappedAttention) -> None:
    """After ``phi='own'``, the BEiT layer around the attention no longer adds its table's bias: the
    layer's ``rpb`` holds the table, saved once under the Φp's name; the model's name loads onto it."""
    hand_held_modules_to_phi(site.parent, layer, site.name)


# a transformers model's config.model_type: what the family reads of its base model
_FAMILIES: Dict[str, HfFamily] = {
    'vit': HfFamily(attention='ViTAttention', num_prefix_tokens=lambda m: 1, absolute=_table, grid_module=_projection),
    'deit': HfFamily(attention='DeiTAttention', num_prefix_tokens=lambda m: 2, absolute=_table, grid_module=_projection),
    'vit_msn': HfFamily(attention='ViTMSNAttention', num_prefix_tokens=lambda m: 1, absolute=_table,
                        grid_module=_projection),
    'ijepa': HfFamily(attention='IJepaAttention', num_prefix_tokens=lambda m: 0, absolute=_table,
                      grid_module=_projection),
    'pixio': HfFamily(attention='PixioAttention', num_prefix_tokens=lambda m: m.config.n_cls_tokens, absolute=_table,
                      grid_module=_projection),
    'dinov2': HfFamily(attention='Dinov2Attention', num_prefix_tokens=lambda m: 1, absolute=_table,
                       grid_module=_projection),
    'dinov2_with_registers': HfFamily(attention='Dinov2WithRegistersAttention',
                                      num_prefix_tokens=lambda m: 1 + m.config.num_register_tokens, absolute=_table,
                                      grid_module=_projection),
    'clip_vision_model': HfFamily(attention='CLIPAttention', num_prefix_tokens=lambda m: 1, absolute=_lookup,
                                  grid_module=_embedding),
    'siglip_vision_model': HfFamily(attention='SiglipAttention', num_prefix_tokens=lambda m: 0, absolute=_lookup,
                                    grid_module=_embedding),
    'chinese_clip_vision_model': HfFamily(attention='ChineseCLIPVisionAttention', num_prefix_tokens=lambda m: 1,
                                          absolute=_lookup, grid_module=_embedding),
    'siglip2_vision_model': HfFamily(attention='Siglip2Attention', num_prefix_tokens=lambda m: 0, absolute=_lookup,
                                     grid_module=lambda m: m.embeddings, read_grid=siglip2_grid,
                                     adapter=HfNaFlexAttention),
    'aimv2_vision_model': HfFamily(attention='Aimv2Attention', num_prefix_tokens=lambda m: 0,
                                   absolute=_aimv2_embedding, grid_module=lambda m: m.embeddings.patch_embed, fixed=_aimv2_fixed),
    'beit': HfFamily(attention='BeitAttention', num_prefix_tokens=lambda m: 1, absolute=_table, grid_module=_projection,
                     adapter=HfBeitAttention, relative=_tables('BeitRelativePositionBias'), converted=_beit_own_phi,
                     installed=_hand_beit_table_to_phi),
    'data2vec-vision': HfFamily(attention='Data2VecVisionAttention', num_prefix_tokens=lambda m: 1, absolute=_table,
                                grid_module=_projection, adapter=HfData2VecAttention,
                                relative=_tables('Data2VecVisionRelativePositionBias'), converted=_data2vec_own_phi),
    'swin': HfFamily(attention='SwinAttention', num_prefix_tokens=lambda m: 0, absolute=_table, grid_module=None,
                     adapter=HfSwinAttention, relative=_tables('SwinRelativePositionBias'),
                     converted=lambda base: _swin_own_phi),
}


@register_family(covers=tuple(f"transformers' {model_type}" for model_type in _FAMILIES))
def hf_vision_transformer(model: nn.Module) -> Optional[SwapPlan]:
    """A transformers model (a ``PreTrainedModel``) whose ``config.model_type`` is a family's: its base
    model's layers (a classifier's head, a CLIP's text tower are not swapped)."""
    PreTrainedModel = imported('transformers.modeling_utils', 'PreTrainedModel')
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        return None
    found = _FAMILIES.get(getattr(model.config, 'model_type', None))
    if found is None:
        return None
    base = model.base_model
    sites = []
    for parent in base.modules():
        for name, attn in parent.named_children():
            if type(attn).__name__ == found.attention:
                sites.append(_site(len(sites), parent, name, attn, found.num_prefix_tokens(base)))
    tables = found.relative(base)
    kept = (lambda site, index: [GivenBias(RELATIVE_POSITION_BIAS)]) if tables else (lambda site, index: [])
    grid = None if found.grid_module is None else GridSource(module=found.grid_module(base), read=found.read_grid)
    return SwapPlan(family=f'transformers {type(model).__name__}', sites=sites, adapter=found.adapter, grid=grid,
                    own=OwnScheme(absolute=found.absolute(base), relative=tables, converted=found.converted(base),
                                  kept=kept, installed=found.installed, fixed=found.fixed(base)))


def _site(index: int, parent: nn.Module, name: str, attn: nn.Module, num_prefix_tokens: int) -> AttentionSite:
    if hasattr(attn, 'attention') and hasattr(attn.attention, 'query'):  # Data2VecVision: transformers 4's layout
        return AttentionSite(parent, name, attn.attention.query.in_features, attn.attention.num_attention_heads,
                             num_prefix_tokens)
    if not hasattr(attn, 'q_proj'):
        raise TypeError(f'layer {index} holds {described(attn)} without q_proj / k_proj / v_proj: the layout of '
                        'transformers < 5, which swap_attention does not read; install transformers >= 5')
    heads = getattr(attn, 'num_attention_heads', None) or attn.num_heads  # per stage in Swin
    width = attn.q_proj.in_features
    if attn.q_proj.out_features != width:
        raise TypeError(f'layer {index} attends in {attn.q_proj.out_features} channels, not the model width {width} '
                        '(head_dim): posattn.Attention splits the width into its heads')
    return AttentionSite(parent, name, width, heads, num_prefix_tokens)


# transformers' vision models whose attention is not self-attention over one token grid
for _model, _reason in {
    'transformers.models.vit_mae.modeling_vit_mae.ViTMAEModel': "ViTMAE's encoder attends over a random subset "
                                                                'of the patches, in shuffled order (whatever its '
                                                                'mask ratio): its tokens are not the patch grid',
    'transformers.models.yolos.modeling_yolos.YolosModel': "YOLOS appends its detection tokens after the patch "
                                                          'tokens: posattn lays the extra tokens before the grid',
    'transformers.models.hiera.modeling_hiera.HieraModel': "Hiera's mask-unit attention pools its queries between "
                                                           'stages: its queries are not the key grid',
    'transformers.models.dinov3_vit.modeling_dinov3_vit.DINOv3ViTModel': "DINOv3's RoPE over patch coordinates is "
                                                                         "not converted (timm's EVA RoPE is): swap "
                                                                         "timm's DINOv3 (an Eva) instead",
    'transformers.models.swinv2.modeling_swinv2.Swinv2Model': "Swin V2's cosine attention (normalised queries and "
                                                              'keys times a learned logit scale, with a position '
                                                              'bias from a continuous MLP) is not the scaled dot '
                                                              'product posattn computes',
}.items():
    register_refusal(_model, _reason)
