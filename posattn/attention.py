"""The one attention layer of posattn: qkv -> logits (+ Φp) -> softmax -> v -> proj."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import torch
from einops import rearrange
from torch import nn

from ._memory import check_fits
from .functional import attention_probs, biased_attention
from .grid import GridLike, TokenGrid
from .layout import ImageLayout
from .phi import PhiStack, PositionalModule, build_layer_phi
from .phi.registry import PhiOptions, PhiSpec
from .positions import TokenPositions, token_positions

Where = Union[TokenGrid, TokenPositions]

__all__ = ['Attention', 'LogitsProbe']

class LogitsProbe(nn.Module):
    """Where the layer's attention logits can be observed: called with (q, k, bias, grid), computes nothing.

    ``q``, ``k``: (B, heads, N, head_dim), unscaled; ``bias``: Φp's logits bias or None; ``grid``:
    the :class:`TokenGrid` of the N tokens (or, on images of different grids run as rows, their
    :class:`~posattn.positions.TokenPositions`); ``key_mask``: the layer's key mask or None, and
    ``attn_mask``: an additive mask of the logits that is not positional (Swin's shift mask in a
    swapped Swin) or None, both passed by keyword (a hook registered ``with_kwargs=True`` sees
    them). A forward hook on it sees exactly what the layer's softmax uses, whatever called the
    layer (``posattn.analysis`` reads attention maps this way). On rows of images the layer then
    writes -inf into a bias of every image at its padding keys: read it within the hook.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, bias: Optional[torch.Tensor], grid: 'Where',
                key_mask: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None) -> None:
        return None


# The layer's sizes a built Φp may state among its settings, which must then be the layer's.
LAYER_SIZES = ('dim', 'num_heads', 'head_dim')


def _check_built_for(phi: PositionalModule, **layer: int) -> None:
    """A ValueError naming the Φp (or stack member) whose settings state another of the layer's sizes
    (:data:`LAYER_SIZES`) than ``layer``'s, before it is ever called."""
    members = phi.members if isinstance(phi, PhiStack) else (phi,)
    for index, member in enumerate(members):
        settings = member.settings()
        wrong = [size for size in LAYER_SIZES if size in settings and settings[size] != layer[size]]
        if wrong:
            which = f'member {index} of the Φp stack, {member.phi_name},' if member is not phi else f'Φp {phi.phi_name}'
            raise ValueError(f'{which} is built for ' + ', '.join(f'{size}={settings[size]}' for size in wrong)
                             + ', but the layer has ' + ', '.join(f'{size}={layer[size]}' for size in wrong)
                             + ': build it for the layer, or give the layer its name and let it build it')


class Attention(nn.Module):
    """Multi-head self-attention with a pluggable positional module Φp.

    For head h, with the tokens x first passed through Φp's token hook,

        A_h = softmax(q_h k_h^T / sqrt(d) + b_h),   out = proj(concat_h(A_h v_h + t_h)),

    where b = Φp's logits bias and t = its value term, q and k are first passed through Φp's
    query/key hook (a rotation) and A through its probability hook (a mixture), each absent
    unless the Φp contributes it (:class:`posattn.phi.PositionalModule`). With ``phi='peripheral'`` this is PerViT's Multi-head Peripheral Attention (Eq. 5),
    with ``'none'`` plain MHSA (Vaswani et al. 2017). The parameter layout (``qkv``: Linear
    dim -> 3 * dim split as (three, heads, head_dim); ``proj``) is timm's, so swapping keeps weights.

    Args:
        dim: token channels C.
        num_heads: attention heads; must divide ``dim``.
        phi: a registered Φp name (``posattn.list_phis()``), a list of names combined in that order
            (:class:`~posattn.phi.PhiStack`: ``['rope', 'rpb']``), or a built :class:`PositionalModule`.
        phi_cfg: options of the named Φp (for a list: a list of option dicts, one per name); what
            the layer knows (``dim``, ``num_heads``, ``head_dim``, ``num_prefix_tokens``) is filled in
            where the Φp takes it (:func:`posattn.phi.build_layer_phi`).
        qkv_bias: bias on the qkv projection.
        attn_drop: dropout on the attention probabilities (materialises them while training).
        proj_drop: dropout after the output projection.
        num_prefix_tokens: extra tokens (class, distillation) before the grid in every input.
        qk_norm: normalise each head's queries and keys (``q_norm``, ``k_norm``: timm's names and
            placement, Dehghani et al. 2023) before the logits and the Φp.
        norm_layer: the normalisation ``qk_norm`` uses, called with ``head_dim``.
        content: False leaves out the content term q k^T (PerViT Table 1 (c), "without Φc"):
            A_h = softmax(b_h), attention by position alone. The layer then projects only the
            values (``v``: Linear dim -> dim, no ``qkv``), and its Φp must give a logits bias.
    """

    def __init__(self, dim: int, num_heads: int, phi: Union[PhiSpec, PositionalModule] = 'none',
                 phi_cfg: PhiOptions = None, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, num_prefix_tokens: int = 0,
                 qk_norm: bool = False, norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
                 content: bool = True):
        super().__init__()
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f'dim {dim} is not divisible by num_heads {num_heads}')
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.num_prefix_tokens = num_prefix_tokens
        if isinstance(phi, PositionalModule):
            if phi_cfg:
                raise ValueError('phi_cfg applies to a Φp given by name, not to a built module')
            _check_built_for(phi, dim=dim, num_heads=num_heads, head_dim=dim // num_heads)
            self.phi = phi
        else:
            self.phi = build_layer_phi(phi, phi_cfg, dim=dim, num_heads=num_heads,
                                       num_prefix_tokens=num_prefix_tokens)
        self.phi.declared_hooks()  # a Φp that declares none is refused here, naming the fix
        if not content and (qk_norm or not self.phi.gives_logits_bias):
            raise ValueError('content=False attends by the Φp\'s logits bias alone: it needs a Φp that '
                             f'declares one (not {type(self.phi).__name__} with hooks '
                             f'{sorted(self.phi.declared_hooks())}) and no qk_norm')
        self.content = content
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias) if content else None
        self.v = None if content else nn.Linear(dim, dim, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.logits_probe = LogitsProbe()

    def forward(self, x: torch.Tensor, hw: Union[GridLike, ImageLayout], key_mask: Optional[torch.Tensor] = None,
                **call_inputs: Any) -> torch.Tensor:
        """x: (B, N, C) with N = num_prefix_tokens + H * W; hw: (H, W) or a TokenGrid. Or, for images
        of different grids in one tensor, x: (B, L, C) and hw: an :class:`~posattn.layout.ImageLayout`
        (padded or packed): each image attends within itself as it would alone (:meth:`forward_layout`).

        ``key_mask``: None, or a bool (B, N) that is False for keys no query may attend to (padding
        tokens of windowed attention). A sequence with no key left attends to nothing: its
        attention output is zero (the layer returns ``proj``'s bias), with zero gradients.
        ``call_inputs``: what the Φp reads that it does not own, declared as its ``call_inputs``
        (PerViT's ``distance_embedding=``), passed on to its hooks.
        """
        given = self.given(call_inputs)
        if isinstance(hw, ImageLayout):
            return self.forward_layout(x, hw, key_mask, given)
        return self.forward_tokens(x, self.grid_of(x, hw), key_mask, given)

    def forward_tokens(self, x: torch.Tensor, where: Where, key_mask: Optional[torch.Tensor],
                       given: Mapping[str, Any]) -> torch.Tensor:
        """The layer on tokens (B, N, C) of one grid, or on rows of images (I, M, C) with their
        :class:`~posattn.positions.TokenPositions`; ``given``: the Φp's call inputs (:meth:`given`)."""
        if self.phi.contributes('tokens'):
            x = self.phi.tokens(x, where, **given)
        if self.content:
            q, k, v = self.split_heads(self.qkv(x))
        else:
            v = rearrange(self.v(x), 'b n (h d) -> b h n d', h=self.num_heads)
            q = k = self._no_content(v)
        out = self.attend(q, k, v, where, key_mask, given=given)
        return self.proj_drop(self.output_projection()(out))

    def forward_layout(self, x: torch.Tensor, layout: ImageLayout, key_mask: Optional[torch.Tensor],
                       given: Mapping[str, Any]) -> torch.Tensor:
        """The layer on a batch of images of different grids, (B, L, C) -> (B, L, C), zero at tokens of
        no image; ``key_mask`` (B, L) as the layout.

        Where the Φp computes its terms from per-token positions
        (:attr:`~posattn.phi.PositionalModule.runs_on_token_positions`), the images are gathered one a
        row and attention runs once over them, the padding of each row masked
        (:mod:`posattn.positions`); otherwise the images of each distinct grid are gathered into one
        batch and run on their grid. Either way :meth:`forward_tokens` computes, once per call or once
        per grid."""
        self.check_layout(x, layout)
        if key_mask is not None and not (isinstance(key_mask, torch.Tensor) and key_mask.dtype == torch.bool
                                         and key_mask.shape == x.shape[:2]):
            got = (f'{key_mask.dtype} of shape {tuple(key_mask.shape)}' if isinstance(key_mask, torch.Tensor)
                   else f'a {type(key_mask).__name__}')
            raise ValueError(f'key_mask must be a bool tensor of shape (B, L) = {tuple(x.shape[:2])}, as the '
                             f'tokens, got {got}')
        if self.phi.runs_on_token_positions:
            positions = token_positions(layout, x.shape[0], x.device)
            keys = positions.valid if key_mask is None else positions.valid & positions.gather(key_mask)
            return positions.place(self.forward_tokens(positions.gather(x), positions, keys, given))
        return layout.per_grid((x, key_mask), lambda group, tokens, keys: self.forward_tokens(
            tokens, group.grid, keys, given), self.dim)

    def check_layout(self, x: torch.Tensor, layout: ImageLayout) -> None:
        """Raise a ValueError unless ``x`` (B, L, C) holds ``layout``'s images with this layer's prefix tokens."""
        self._check_input(x)
        layout.check_tokens(x)
        if layout.num_prefix_tokens != self.num_prefix_tokens:
            raise ValueError(f'the images of this {layout} have {layout.num_prefix_tokens} prefix tokens; '
                             f'this layer has {self.num_prefix_tokens}')

    def output_projection(self) -> nn.Module:
        """The projection of the attended heads back to the tokens' width (``proj``; a swapped layer
        may keep the model's under the model's name)."""
        return self.proj

    def taking(self, offered: Mapping[str, Any]) -> Dict[str, Any]:
        """Of what a model offers every layer (its shared state), what this layer's Φp declares it reads:
        a model passes ``layer(x, hw, **layer.taking(offered))``, whatever Φp each layer holds."""
        return {name: value for name, value in offered.items() if name in self.phi.call_inputs}

    def given(self, call_inputs: Mapping[str, Any]) -> Dict[str, Any]:
        """The call inputs the Φp declared, or a TypeError naming one it did not declare or one missing."""
        unknown = sorted(set(call_inputs) - set(self.phi.call_inputs))
        if unknown:
            reads = ', '.join(self.phi.call_inputs) or 'nothing'
            raise TypeError(f'got {", ".join(unknown)} with the call; this layer\'s Φp ({type(self.phi).__name__}) '
                            f'reads {reads} given with a call')
        return self.phi.given(call_inputs)

    @staticmethod
    def _no_content(v: torch.Tensor) -> torch.Tensor:
        """Queries and keys of a position-only layer: one zero channel (B, heads, N, 1), a
        broadcast view, so that q k^T = 0 and the softmax, the Φp and the logits probe see the
        Φp's bias alone (analyses then read Φc as uniform)."""
        batch, heads, tokens, _ = v.shape
        return v.new_zeros(1, heads, tokens, 1).expand(batch, -1, -1, -1)

    def grid_of(self, x: torch.Tensor, hw: GridLike) -> TokenGrid:
        """The :class:`TokenGrid` of ``x`` (B, N, C), checked against its channels, dtype and N."""
        grid = TokenGrid.of(hw, self.num_prefix_tokens)
        self._check_input(x)
        grid.check_num_tokens(x.shape[1])
        return grid

    def split_heads(self, qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv (B, N, 3 * heads * d) -> q, k, v, each (B, heads, N, d), with q and k normalised."""
        q, k, v = rearrange(qkv, 'b n (three h d) -> three b h n d', three=3, h=self.num_heads).unbind(0)
        return self.q_norm(q), self.k_norm(k), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: Where,
               key_mask: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None, *,
               given: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + Φp's bias + attn_mask) v (+ Φp's value term), heads merged:
        (B, N, heads * d), before the output projection; q and k pass the Φp's
        :meth:`~posattn.phi.PositionalModule.queries_keys` first, and the probabilities its
        :meth:`~posattn.phi.PositionalModule.mix_probabilities`.

        ``where``: the :class:`TokenGrid` of the N tokens, or the
        :class:`~posattn.positions.TokenPositions` of rows of images, whose Φp hooks are then the
        ``_at`` forms. ``attn_mask``: an additive mask of the logits, broadcastable to (B, heads, N, N),
        that is not positional (Swin's shift mask, -100 between regions a shifted window joins), or
        None; every positional term is the Φp's. ``given``: the call inputs the Φp declared
        (:meth:`given`), passed on to its hooks.
        """
        given = given or {}
        phi = self.phi
        materialised = self._materialises_probabilities()
        keeps_a_key = isinstance(where, TokenPositions) and key_mask is not None and where.keeps_a_key(key_mask)
        # a mixture under a key mask that cuts a grid forms its (B, heads, N, N) positional attention
        self._check_memory(q, where, materialised or (phi.mixes_probabilities and key_mask is not None
                                                       and not keeps_a_key))
        if phi.transforms_queries_keys:
            q, k = phi.hook('queries_keys', where)(q, k, where, **given)
        phi_bias = phi.hook('logits_bias', where)(q, k, where, **given) if phi.gives_logits_bias else None
        self.logits_probe(q, k, phi_bias, where, key_mask=key_mask, attn_mask=attn_mask)
        bias = phi_bias if attn_mask is None else attn_mask if phi_bias is None else phi_bias + attn_mask
        keys = key_mask
        if keeps_a_key and bias is not None and bias.shape[0] == q.shape[0] and bias.shape[-1] == k.shape[2]:
            # the padding folded into the bias of every image, the Φp's for this call (a padding key's
            # gradient is zero either way): no (I, heads, M, M) sum with the mask, forward or backward
            keys = None
            where.mask_padding_keys_(bias.detach())
        if materialised:
            attn = attention_probs(q, k, bias, keys, keeps_a_key=keeps_a_key)
            if phi.mixes_probabilities:
                attn = phi.hook('mix_probabilities', where)(attn, where, key_mask, **given)
            attn = self.attn_drop(attn)
            out = attn @ v
            value_term = phi.hook('value_term', where)(attn, where, **given) if phi.contributes('value_term') else None
            if value_term is not None:
                out = out + value_term
        else:
            out = biased_attention(q, k, v, bias, keys, keeps_a_key=keeps_a_key)
            if phi.mixes_probabilities:  # its form on the outputs: no (B, heads, N, N) probabilities
                out = phi.hook('mix_outputs', where)(out, v, where, key_mask, **given)
        return rearrange(out, 'b h n d -> b n (h d)')

    def _materialises_probabilities(self) -> bool:
        """Whether this call forms the (B, heads, N, N) probabilities: for a Φp's value term or a
        mixture with no form on the outputs, or for attention dropout while training; otherwise the
        fused kernel runs."""
        return (self.phi.needs_probabilities
                or (self.training and self.attn_drop.p > 0))

    def _check_memory(self, q: torch.Tensor, grid: Where, materialised: bool) -> None:
        """Fail before the work when the (heads, N, N) terms this call needs cannot fit: a
        positional bias (and its computation, about as large again; once per image for a bias that
        depends on the tokens), and the attention probabilities (B, heads, N, N) where they are
        materialised (or a mixture's, as large). A traced call (``torch.compile``, ``torch.export``)
        checks nothing: its sizes may be symbolic, and the check would fix them."""
        if torch.compiler.is_compiling():
            return
        batch, heads, tokens, _ = q.shape
        per_image = self.phi.bias_per_image or isinstance(grid, TokenPositions)  # images of other grids differ
        pair_terms = (2 * (batch if per_image else 1)) if self.phi.gives_logits_bias else 0
        if materialised:
            pair_terms += 2 * batch
        nbytes = pair_terms * heads * tokens * tokens * q.element_size()
        check_fits(nbytes, q.device, f'attention over {tokens} tokens ({grid}) in {heads} heads',
                   'give it a smaller input, or attend within windows (posattn.window, the dense '
                   'backbones\' window_size)')

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 3:
            raise ValueError(f'expected tokens (B, N, C), got shape {tuple(x.shape)}')
        if x.shape[-1] != self.dim:
            raise ValueError(f'got tokens with {x.shape[-1]} channels; this layer has dim {self.dim}')
        dtype = self.output_projection().weight.dtype
        if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f'tokens are {x.dtype} but the layer\'s parameters are {dtype}: '
                            f'convert one to the other (model.to(dtype) or x.to(dtype)), or run under torch.autocast')

    def __prepare_scriptable__(self) -> 'Attention':
        raise RuntimeError('posattn layers do not support torch.jit.script (the Φp registry and the '
                           'positional kernels are Python); use torch.compile(model), or '
                           'torch.export.export(model, (example_input,)) for a graph')

    def extra_repr(self) -> str:
        return (f'num_heads={self.num_heads}, head_dim={self.head_dim}, num_prefix_tokens={self.num_prefix_tokens}'
                + ('' if self.content else ', content=False'))
