"""``peripheral``: PerViT's peripheral position encoding, the Φp of Multi-head Peripheral Attention.

PerViT (Min et al., NeurIPS 2022), Eq. 5-8, as the authors' release computes it:

    MPA_h = Normalize_rows[exp(S_h) * Φp_h] V_h = softmax(S_h + log Φp_h) V_h,
    Φp_h  = sigmoid(z_h),  log Φp_h = logsigmoid(z_h),
    z     = IN2(PP2(ReLU(IN1(PP1(R))))),   R[q, k, r] = w_r * ||c_k - c_q||,

with c the grid coordinates (``linspace(-1, 1, n)`` per axis), keys padded by 2 on every side
with the real extrapolated coordinates, PP1 / PP2 3x3 valid convolutions over the key grid
(4 heads -> 16 hidden channels -> one map per head), IN instance norms over the key grid with
affine parameters, and w the distance embedding (one per model in the release). How it is
computed, exactly and without the (queries, keys, channels) tensor of the formula:
:mod:`posattn.phi.peripheral_kernel`.

The paper's other Φp designs (Table 5, bottom; supplement Fig. A6) are options of the same module:
the embedding R ('euc' above, or 'lrn', :class:`LearnedEmbedding`), the neighbourhood N of the
projections (3x3, or 1x1 without it) and the multi-layer design ML (without it a single
projection: z = IN2(PP2(R))).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..functional import function_transforms_active
from ..grid import TokenGrid
from .base import PositionalModule
from .peripheral_kernel import (KERNEL_SIZE, PeripheralWeights, axis_offsets, design_log_attention,
                                distance_canvas, peripheral_log_attention)
from .registry import register_phi

__all__ = ['PeripheralPhi', 'PeripheralWeights', 'DistanceEmbedding', 'LearnedEmbedding', 'EMBEDDINGS', 'PHI_INITS',
           'conv_init', 'peripheral_init', 'peripheral_log_attention', 'design_log_attention', 'distance_canvas',
           'random_init_']

def _check_layer(layer_index: int, num_layers: int) -> None:
    if not 0 <= layer_index < num_layers:
        raise ValueError(f'layer_index {layer_index} is outside 0..{num_layers - 1}')


def peripheral_init(layer_index: int, num_layers: int) -> Tuple[float, float]:
    """The release's second-norm initialisation (s_l, v_l) of layer ``layer_index`` of ``num_layers``.

    s_l = linspace(-5, 4, L)[l] sets the size and v_l = linspace(3, 0.01, L)[l] the strength of
    the initial local attention (PerViT Sec. 3.2 and Appendix A): early layers start local and
    strong, late layers near uniform.
    """
    _check_layer(layer_index, num_layers)
    bias = torch.linspace(-5.0, 4.0, num_layers, dtype=torch.float64, device='cpu')[layer_index].item()
    weight = torch.linspace(3.0, 0.01, num_layers, dtype=torch.float64, device='cpu')[layer_index].item()
    return bias, weight


def conv_init(layer_index: int, num_layers: int) -> Tuple[float, float]:
    """The paper's "conv" initialisation (Table 5): s_l = -5, v_l = 3 in every layer, the first
    layer's peripheral values (small, strong, local attention everywhere)."""
    _check_layer(layer_index, num_layers)
    return -5.0, 3.0


def random_init_(parameter: torch.Tensor) -> torch.Tensor:
    """The paper's "rand" initialisation of one Φp parameter, in place: N(0, 1) truncated to
    [-2, 2]. The paper does not state a distribution; the instance norms after the distance
    embedding and each projection make Φp independent of their weights' scale."""
    with torch.no_grad():
        return nn.init.trunc_normal_(parameter, std=1.0, a=-2.0, b=2.0)


# Φp initialisations of the paper's Table 5 (top) and supplement Tab. A3: the second norm's
# (s_l, v_l) by layer, or None where every parameter is drawn by :func:`random_init_`.
PHI_INITS = {'peripheral': peripheral_init, 'conv': conv_init, 'rand': None}


class DistanceEmbedding(nn.Module):
    """Multi-scale distance embedding R[q, k, r] = w_r * ||c_k - c_q|| (PerViT Eq. 6, 'Euc').

    The weight of the release's ``nn.Linear(1, 4 * heads)``, one for the whole model: (num_scales,
    1), initialised to -0.02. The release's bias b_r adds a constant that the first instance norm
    removes, so it is no parameter here (converting a release checkpoint drops it).
    """

    def __init__(self, num_scales: int):
        super().__init__()
        self.weight = nn.Parameter(torch.full((num_scales, 1), -0.02))

    @property
    def num_channels(self) -> int:
        return self.weight.shape[0]

    def canvas(self, height: int, width: int, pad: int) -> torch.Tensor:
        """R at every key-minus-query offset of an H x W grid with keys padded by ``pad``:
        (channels, 2H-1+2pad, 2W-1+2pad), float64."""
        distances = distance_canvas(height, width, pad).to(self.weight.device)
        return self.weight.double()[:, :, None] * distances


class LearnedEmbedding(nn.Module):
    """Learned relative embedding R[q, k, :] = T(c_k - c_q) (PerViT Table 5's 'Lrn').

    The paper describes Lrn in one phrase, "relative distances between learnable vectors"; here T
    is a learnable table of ``num_channels`` vectors over the plane of offsets [-2, 2]^2, in the
    grid coordinates of :class:`DistanceEmbedding` (``linspace(-1, 1, n)`` per axis), read
    bilinearly at each offset (border values beyond). Its ``table_size`` x ``table_size`` cells
    sit exactly on the offsets of a ((table_size + 1) / 2)-sided grid (14 x 14 by default), and
    being a function of the offset in grid coordinates, it serves every grid, one per model as
    the distance embedding. It starts as Euc's initial embedding, -0.02 ||offset|| in every
    channel, so that the initialisations of Table 5 start the two alike.
    """

    def __init__(self, num_channels: int, table_size: int = 27):
        super().__init__()
        if table_size < 2:
            raise ValueError(f'table_size must be at least 2, got {table_size}')
        offsets = torch.linspace(-2.0, 2.0, table_size, dtype=torch.float64)
        norms = torch.sqrt(offsets[:, None] ** 2 + offsets[None, :] ** 2)
        self.table = nn.Parameter((-0.02 * norms).float().expand(num_channels, -1, -1).clone())

    @property
    def num_channels(self) -> int:
        return self.table.shape[0]

    def canvas(self, height: int, width: int, pad: int) -> torch.Tensor:
        """R at every key-minus-query offset of an H x W grid with keys padded by ``pad``:
        (channels, 2H-1+2pad, 2W-1+2pad), float64."""
        rows, cols = (axis_offsets(n, pad).to(self.table.device) / 2 for n in (height, width))
        points = torch.stack(torch.broadcast_tensors(cols[None, :], rows[:, None]), -1)  # (x, y) in [-1, 1]
        return F.grid_sample(self.table.double()[None], points[None], mode='bilinear', padding_mode='border',
                              align_corners=True)[0]


def _refuse_function_transforms() -> None:
    """A clear error, instead of PyTorch's about autograd.Function internals, under torch.func."""
    if function_transforms_active():
        raise RuntimeError(
            "torch.func transforms (vmap, grad, jvp, jacrev, functional ensembles) cannot run the peripheral "
            "Φp, whose kernel is a torch.autograd.Function with its own backward: take gradients with "
            "torch.autograd (loss.backward(), torch.autograd.grad), and run an ensemble's models one after "
            "another (torch.func.functional_call in a loop works).")


# R, the embedding of relative positions that a peripheral Φp projects (Table 5, bottom).
EMBEDDINGS = {'euc': DistanceEmbedding, 'lrn': LearnedEmbedding}


@register_phi('peripheral')
class PeripheralPhi(PositionalModule):
    """PerViT's peripheral Φp: a batch-free logits bias logsigmoid(z) shared by the batch.

    Pairs involving prefix (class) tokens get no bias. Every call computes the bias, except inside
    :func:`posattn.cache_positions`, which serves it again per grid while the weights are unchanged.

    Args:
        num_heads: attention heads; the distance embedding and hidden maps have 4 * heads
            channels (paper: D_r = D_hid = 4 N_h).
        layer_index: this layer's index among ``num_layers`` for the release's layer-dependent
            initialisation of the second norm (:func:`peripheral_init`); the default single
            layer gets s = -5, v = 3, the paper's "conv" initialisation.
        num_layers: number of layers the initialisation spreads over.
        shared_embedding: the distance embedding R is its model's, shared by the layers (the release
            keeps one per model), owned by the model and given with each call as
            ``distance_embedding=`` (the layer passes it on to :meth:`logits_bias`): the model's
            state_dict holds it once. False (the default) gives this module its own.
        init: 'peripheral' (the release's, by layer), 'conv' (s = -5, v = 3 in every layer) or
            'rand' (every parameter random, :func:`random_init_`; a shared distance embedding
            is its owner's to initialise): the initialisations of the paper's Table 5.
        embedding: R, 'euc' (:class:`DistanceEmbedding`, PerViT's) or 'lrn'
            (:class:`LearnedEmbedding`); a shared one given with a call must be of that kind.
        neighbourhood: the projections refer to the 3x3 neighbourhood N of each key (PerViT's
            peripheral projection); False makes them 1x1, each key on its own.
        multi_layer: ML, PP1 -> IN1 -> ReLU -> PP2 -> IN2 (PerViT's); False is one projection
            from R to the heads, z = IN2(PP2(R)) (no ``proj1_weight``, ``norm1_*``).
        The last three are Table 5's designs (bottom); the defaults build PerViT's Φp.
    """

    def __init__(self, num_heads: int, layer_index: int = 0, num_layers: int = 1,
                 shared_embedding: bool = False, init: str = 'peripheral',
                 embedding: str = 'euc', neighbourhood: bool = True, multi_layer: bool = True):
        super().__init__(hooks=('logits_bias',), call_inputs=('distance_embedding',) if shared_embedding else (),
                         reaches_prefix_queries=False)  # pairs that involve a prefix token get no bias
        if init not in PHI_INITS:
            raise ValueError(f'unknown Φp initialisation {init!r}; choose one of {sorted(PHI_INITS)}')
        if embedding not in EMBEDDINGS:
            raise ValueError(f'unknown Φp embedding {embedding!r}; choose one of {sorted(EMBEDDINGS)}')
        if not isinstance(shared_embedding, bool):
            raise ValueError(f'shared_embedding must be True or False, got {shared_embedding!r}')
        channels = 4 * num_heads
        self.distance_embedding = None if shared_embedding else EMBEDDINGS[embedding](channels)
        self.num_heads = num_heads
        self.init = init
        self.embedding, self.neighbourhood, self.multi_layer = embedding, neighbourhood, multi_layer
        size, strength = (PHI_INITS[init] or peripheral_init)(layer_index, num_layers)
        k = KERNEL_SIZE if neighbourhood else 1
        # No PP1 / PP2 biases: each adds a constant that the next instance norm removes.
        if multi_layer:
            self.proj1_weight = nn.Parameter(torch.full((channels, channels, k, k), 0.02))
            self.norm1_weight = nn.Parameter(torch.ones(channels))
            self.norm1_bias = nn.Parameter(torch.zeros(channels))
        else:
            self.proj1_weight = self.norm1_weight = self.norm1_bias = None
        self.proj2_weight = nn.Parameter(torch.full((num_heads, channels, k, k), 0.02))
        self.norm2_weight = nn.Parameter(torch.full((num_heads,), strength))  # v_l: strength
        self.norm2_bias = nn.Parameter(torch.full((num_heads,), size))  # s_l: size
        if PHI_INITS[init] is None:
            for parameter in self.parameters():  # the distance embedding too where this module owns it
                random_init_(parameter)

    def embedding_of(self, distance_embedding: Optional[nn.Module] = None) -> nn.Module:
        """R's module: this module's own, or (``shared_embedding``) the model's ``distance_embedding``
        given with the call, checked against this Φp's kind and width."""
        if self.distance_embedding is not None:
            if distance_embedding is not None and distance_embedding is not self.distance_embedding:
                raise ValueError('this peripheral Φp has its own distance embedding and takes none with a call; '
                                 'build it with shared_embedding=True to read its model\'s')
            return self.distance_embedding
        if distance_embedding is None:
            raise TypeError("this peripheral Φp reads its model's distance embedding (shared_embedding=True), given "
                            'with each call: pass distance_embedding=model.distance_embedding')
        kind, channels = EMBEDDINGS[self.embedding], 4 * self.num_heads
        if not isinstance(distance_embedding, kind) or distance_embedding.num_channels != channels:
            raise ValueError(f'this peripheral Φp reads a {kind.__name__} of {channels} channels ({self.num_heads} '
                             f'heads, embedding={self.embedding!r}), got {type(distance_embedding).__name__} of '
                             f'{getattr(distance_embedding, "num_channels", "?")}')
        return distance_embedding

    @property
    def is_pervit_design(self) -> bool:
        """PerViT's own design, Euc + N + ML (the release's, on the fast path)."""
        return self.embedding == 'euc' and self.neighbourhood and self.multi_layer

    def weights(self, distance_embedding: Optional[nn.Module] = None) -> PeripheralWeights:
        """The parameters, as :func:`peripheral_log_attention` and
        :func:`posattn.reference.peripheral_position_attention` take them (PerViT's design only);
        ``distance_embedding``: the model's, where it is shared (:meth:`embedding_of`)."""
        if not self.is_pervit_design:
            raise ValueError(f'weights() holds the parameters of PerViT\'s design (euc, neighbourhood, multi-layer); '
                             f'this Φp is {self.design}')
        return PeripheralWeights(self.embedding_of(distance_embedding).weight, self.proj1_weight, self.norm1_weight,
                                 self.norm1_bias, self.proj2_weight, self.norm2_weight, self.norm2_bias)

    @property
    def design(self) -> str:
        """Table 5's name of the design: 'Euc + N + ML' (PerViT's), 'Lrn + ML', 'Euc', ..."""
        return ' + '.join([self.embedding.capitalize()] + ['N'] * self.neighbourhood + ['ML'] * self.multi_layer)

    def log_position_attention(self, height: int, width: int,
                               distance_embedding: Optional[nn.Module] = None) -> torch.Tensor:
        """log Φp for an H x W grid: (heads, H*W, H*W) in the parameters' dtype, [head, query, key];
        ``distance_embedding``: the model's, where it is shared (:meth:`embedding_of`)."""
        _refuse_function_transforms()
        embedding = self.embedding_of(distance_embedding)
        device_type = self.proj2_weight.device.type
        # Some devices ('meta') have no autocast to turn off. Under torch.compile the device is a real
        # one, and some torch releases (2.11) cannot trace the availability check.
        if not (torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)):
            return self._log_position_attention(height, width, embedding)
        with torch.autocast(device_type, enabled=False):
            return self._log_position_attention(height, width, embedding)

    def _log_position_attention(self, height: int, width: int, embedding: nn.Module) -> torch.Tensor:
        if self.is_pervit_design:
            return peripheral_log_attention(height, width, self.weights(embedding))
        reach = (self.proj2_weight.shape[-1] - 1) // 2 * (2 if self.multi_layer else 1)
        return design_log_attention(height, width, embedding.canvas(height, width, reach),
                                    self.proj2_weight, self.norm2_weight, self.norm2_bias,
                                    self.proj1_weight, self.norm1_weight, self.norm1_bias)

    def position_attention(self, height: int, width: int,
                           distance_embedding: Optional[nn.Module] = None) -> torch.Tensor:
        """Φp itself (heads, H*W, H*W), values in (0, 1), indexed [head, query, key]."""
        return torch.exp(self.log_position_attention(height, width, distance_embedding))

    def position_bias(self, grid: TokenGrid, dtype: torch.dtype, device: Optional[torch.device] = None,
                      distance_embedding: Optional[nn.Module] = None) -> torch.Tensor:
        """log Φp on ``grid``, zero wherever a prefix token is: (1, heads, N, N) in ``dtype``, on the
        parameters' device; the logits bias (:meth:`logits_bias`, served by :func:`posattn.cache_positions`)."""
        bias = grid.pad_prefix(self.log_position_attention(grid.height, grid.width, distance_embedding))
        return bias.to(dtype).unsqueeze(0)  # (1, heads, N, N)

    def settings(self) -> Dict[str, Any]:
        # init and the layer's place only initialise the weights
        return {'num_heads': self.num_heads, 'shared_embedding': self.distance_embedding is None,
                'embedding': self.embedding, 'neighbourhood': self.neighbourhood, 'multi_layer': self.multi_layer}
