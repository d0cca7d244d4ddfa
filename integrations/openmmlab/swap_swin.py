"""The OpenMMLab Swin Transformers as :func:`posattn.swap_attention` families.

* mmdet's ``SwinTransformer`` (the Mask R-CNN, Cascade R-CNN and RetinaNet Swin backbones),
* mmseg's ``SwinTransformer`` (UPerNet Swin), the same code as mmdet's, and
* mmpretrain's ``SwinTransformer`` (classification):

every ``ShiftWindowMSA`` keeps cutting its windows, rolling and masking, and its ``w_msa``
(``WindowMSA``, called ``w_msa(windows, mask=None)``) becomes posattn's window attention
(:class:`posattn.swap.window_tables.WindowTableAttention`). The relative position table and index keep
their names, so the toolboxes' checkpoints load before and after the swap; ``absolute_pos_embed``
(``use_abs_pos_embed=True``) is the model's absolute position embedding. Refused: a ``qk_scale``
other than None, a ``w_msa`` of another class (mmpretrain's ``WindowMSAV2`` included), and
mmpretrain's ``SwinTransformerV2``, whose attention is cosine attention.

None of these libraries is imported here: a family recognises a model only once its library is loaded.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from posattn.swap import AttentionSite, OwnScheme, SwapPlan, register_family
from posattn.swap.core import described, imported
from posattn.swap.window_tables import COSINE_ATTENTION, WindowTableAttention, kept_table, table_phi, tables_of

__all__ = ['openmmlab_swin_transformer']

_PRETRAIN_ATTENTION = 'mmpretrain.models.utils.attention'


def _swin_plan(family: str, model: nn.Module, ShiftWindowMSA: type, WindowMSA: type) -> SwapPlan:
    """The ``w_msa`` of every ``ShiftWindowMSA`` of an OpenMMLab Swin, in depth order."""
    sites = []
    for i, shifted in enumerate(m for m in model.modules() if isinstance(m, ShiftWindowMSA)):
        attn, where = shifted.w_msa, f'the window attention of block {i} of {described(model)}'
        if type(attn) is not WindowMSA:
            raise TypeError(f'cannot swap {where}: it is {described(attn)}, not {WindowMSA.__module__}.WindowMSA')
        head_dim = attn.embed_dims // attn.num_heads
        if attn.scale != head_dim ** -0.5:
            raise ValueError(f'cannot swap {where}: it was built with qk_scale={attn.scale}, not the head_dim ** -0.5 '
                             f'= {head_dim ** -0.5:.6g} that posattn scales its logits by: build it with qk_scale=None')
        sites.append(AttentionSite(shifted, 'w_msa', attn.embed_dims, attn.num_heads))
    embeddings = [model.absolute_pos_embed] if model.use_abs_pos_embed else []
    return SwapPlan(family=family, sites=sites, adapter=WindowTableAttention,
                    own=OwnScheme(absolute=embeddings, relative=tables_of(sites), converted=table_phi, kept=kept_table))


# family: (the module of its SwinTransformer, the module of its ShiftWindowMSA and WindowMSA)
_SWINS = {
    'mmdet SwinTransformer': ('mmdet.models.backbones.swin', 'mmdet.models.backbones.swin'),
    'mmseg SwinTransformer': ('mmseg.models.backbones.swin', 'mmseg.models.backbones.swin'),
    'mmpretrain SwinTransformer': ('mmpretrain.models.backbones.swin_transformer', _PRETRAIN_ATTENTION),
}


@register_family(covers=("mmdet's SwinTransformer", "mmseg's SwinTransformer", "mmpretrain's SwinTransformer"))
def openmmlab_swin_transformer(model: nn.Module) -> Optional[SwapPlan]:
    SwinTransformerV2 = imported('mmpretrain.models.backbones.swin_transformer_v2', 'SwinTransformerV2')
    if SwinTransformerV2 is not None and isinstance(model, SwinTransformerV2):
        raise TypeError(f'cannot swap {described(model)}: {COSINE_ATTENTION}')
    for family, (backbone, attention) in _SWINS.items():
        SwinTransformer = imported(backbone, 'SwinTransformer')
        if SwinTransformer is not None and isinstance(model, SwinTransformer):
            return _swin_plan(family, model, imported(attention, 'ShiftWindowMSA'), imported(attention, 'WindowMSA'))
    return None
