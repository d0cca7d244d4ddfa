"""timm's ``SwinTransformer`` (swin_tiny ... swin_large, any window size, square or not, fixed or
dynamic image size), also built with ``features_only=True``: the ``WindowAttention`` of every
``SwinTransformerBlock``, called with the windows its block cut and the block's shift mask. The
relative position table stays, under timm's names; ``set_input_size`` still resizes it after the swap.
With ``phi='own'`` each table becomes an ``rpb`` Φp's (the same Parameter), which ``set_input_size``
resizes as timm resizes its own, so the swapped model stays timm's.
Swin V2 (``SwinTransformerV2``, ``SwinTransformerV2Cr``) is refused: its attention is cosine attention."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

from .core import AttentionSite, OwnScheme, SwapPlan, described, imported, register_family
from .window_tables import COSINE_ATTENTION, WindowTableAttention, kept_table, resize_table, table_phi, tables_of

_SWIN = 'timm.models.swin_transformer'


class TimmWindowAttention(WindowTableAttention):
    """timm's ``WindowAttention``: ``attn(windows, mask=None)``, resized by ``set_window_size``."""

    def set_window_size(self, window_size: Tuple[int, int]) -> None:
        """timm's own resize (``SwinTransformer.set_input_size`` calls it): the table is interpolated
        to the new window and the index rebuilt, the Φp's table too after ``phi='own'``
        (:func:`~posattn.swap.window_tables.resize_table`); the Φp follows the new window grid by itself."""
        WindowAttention = imported(_SWIN, 'WindowAttention')
        resize_table(self, lambda layer: WindowAttention.set_window_size(layer, window_size))


def _is_swin(model: nn.Module) -> bool:
    """A timm SwinTransformer, or a ``features_only`` wrapper, which holds its stages directly."""
    SwinTransformer, Stage = imported(_SWIN, 'SwinTransformer'), imported(_SWIN, 'SwinTransformerStage')
    if SwinTransformer is None:
        return False
    return isinstance(model, SwinTransformer) or any(isinstance(child, Stage) for child in model.children())


@register_family(covers=("timm's SwinTransformer",))
def timm_swin_transformer(model: nn.Module) -> Optional[SwapPlan]:
    version_2 = (imported('timm.models.swin_transformer_v2', 'SwinTransformerV2'),
                 imported('timm.models.swin_transformer_v2_cr', 'SwinTransformerV2Cr'))
    if isinstance(model, tuple(filter(None, version_2))):
        raise TypeError(f'cannot swap {described(model)}: {COSINE_ATTENTION}')
    if not _is_swin(model):
        return None
    Block, WindowAttention = imported(_SWIN, 'SwinTransformerBlock'), imported(_SWIN, 'WindowAttention')
    sites = []
    for i, block in enumerate(m for m in model.modules() if isinstance(m, Block)):
        attn = block.attn
        if not isinstance(attn, WindowAttention):
            raise TypeError(f'Swin block {i} holds {described(attn)}, not timm\'s WindowAttention: '
                            'swap_attention replaces the attention of timm\'s SwinTransformerBlock only')
        head_dim = attn.qkv.out_features // 3 // attn.num_heads
        if head_dim * attn.num_heads != attn.dim:
            raise TypeError(f'Swin block {i} attends in {attn.num_heads} heads x {head_dim} channels, not the block '
                            f'width {attn.dim} (head_dim): posattn.Attention splits the width into its heads')
        sites.append(AttentionSite(block, 'attn', attn.dim, attn.num_heads))
    return SwapPlan(family='timm SwinTransformer', sites=sites, adapter=TimmWindowAttention,
                    own=OwnScheme(relative=tables_of(sites), converted=table_phi, kept=kept_table))
