"""The PerViT release model re-written for the tests from `../shared/spec/pervit.md`, float64.

It is independent of posattn's model code: the release's module names (so a release-layout
state_dict loads into it with ``strict=True``), its literal Φp
(``posattn.reference.peripheral_position_attention``: the full distance tensor, every channel,
every dead bias) and its L1-normalised attention (``posattn.reference.peripheral_attention``). It is validated against the Tiny fixture in
``test_convert.py`` and is then the reference for Small and Medium, for which no fixture exists.

    model = ReleasePerViT('small').double().eval()
    spec = release_spec('small')                      # [(key, shape), ...] in state_dict order
    out = model(images)                               # {'logits', 'block_out', 'phi_p'}
"""
import torch
import torch.nn.functional as F
from torch import nn

from posattn.phi.peripheral import PeripheralWeights
from posattn.reference import peripheral_attention, peripheral_position_attention

# heads, stage dims, conv-stem dims (spec "PerViT models"; paper Table A5)
LAYOUTS = {
    'tiny': (4, (128, 192, 224, 280), (48, 64, 96, 128)),
    'small': (8, (272, 320, 368, 464), (64, 128, 192, 272)),
    'medium': (12, (312, 468, 540, 684), (64, 192, 256, 312)),
}
DEPTHS = (2, 2, 6, 2)


class ConvLayers(nn.Module):
    def __init__(self, stem_dims, embed_dim):
        super().__init__()
        dims = (3,) + tuple(stem_dims)
        self.conv_layers = nn.Sequential(*[
            nn.Sequential(nn.Conv2d(c_in, c_out, 3, 2, 1), nn.BatchNorm2d(c_out), nn.ReLU())
            for c_in, c_out in zip(dims[:-1], dims[1:])])
        self.conv1x1 = nn.Conv2d(dims[-1], embed_dim, 1)

    def forward(self, x):
        return self.conv1x1(self.conv_layers(x))


class PeripheralProjections(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        c = 4 * num_heads
        self.conv1 = nn.Conv2d(c, c, 3)
        self.conv2 = nn.Conv2d(c, num_heads, 3)
        self.gn1 = nn.GroupNorm(c, c)
        self.gn2 = nn.GroupNorm(num_heads, num_heads)


class MPA(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.activation = PeripheralProjections(num_heads)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)


class DepthwiseConv(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, 3, 1, 1, groups=dim)


class Mlp(nn.Module):
    def __init__(self, dim, hidden, out_dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)


class Block(nn.Module):
    def __init__(self, dim, out_dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        if out_dim != dim:
            self.res_path = nn.Linear(dim, out_dim)
        self.attn = MPA(dim, num_heads)
        self.conv = DepthwiseConv(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim, out_dim)


class ReleasePerViT(nn.Module):
    """The release's layout and eval-mode forward; ``forward`` returns logits, block outputs, Φp."""

    def __init__(self, size, num_classes=1000):
        super().__init__()
        self.num_heads, embed_dims, stem_dims = LAYOUTS[size]
        dims = [d for d, n in zip(embed_dims, DEPTHS) for _ in range(n)]
        self.conv_layers = ConvLayers(stem_dims, embed_dims[0])
        self.rpe_proj = nn.Linear(1, 4 * self.num_heads)
        self.blocks = nn.ModuleList([Block(d, out, self.num_heads)
                                     for d, out in zip(dims, dims[1:] + dims[-1:])])
        self.norm = nn.LayerNorm(embed_dims[-1], eps=1e-6)
        self.head = nn.Linear(embed_dims[-1], num_classes)

    def phi_p(self, block, height, width):
        a = block.attn.activation
        return peripheral_position_attention(height, width, PeripheralWeights(  # (heads, HW, HW)
            self.rpe_proj.weight, a.conv1.weight, a.gn1.weight, a.gn1.bias, a.conv2.weight, a.gn2.weight,
            a.gn2.bias, distance_bias=self.rpe_proj.bias, proj1_bias=a.conv1.bias, proj2_bias=a.conv2.bias))

    @torch.no_grad()
    def forward(self, images):
        fmap = self.conv_layers(images)
        height, width = fmap.shape[-2:]
        x = fmap.flatten(2).transpose(1, 2)  # (B, HW, C)
        block_out, phi_ps = {}, {}
        for i, block in enumerate(self.blocks):
            phi_ps[i] = self.phi_p(block, height, width)
            grid = x.transpose(1, 2).reshape(x.shape[0], -1, height, width)
            cpe = block.conv.proj(grid).flatten(2).transpose(1, 2)
            qkv_bias = torch.zeros(block.attn.to_qkv.weight.shape[0], dtype=x.dtype)
            x = x + peripheral_attention(block.norm1(cpe), block.attn.to_qkv.weight, qkv_bias,
                                      block.attn.proj.weight, block.attn.proj.bias,
                                      self.num_heads, phi_ps[i], 0)
            residual = block.res_path(x) if hasattr(block, 'res_path') else x
            hidden = F.gelu(block.mlp.fc1(block.norm2(x)))
            x = block_out[i] = residual + block.mlp.fc2(hidden)
        logits = self.head(self.norm(x).mean(1))
        return {'logits': logits, 'block_out': block_out, 'phi_p': phi_ps}


def release_spec(size):
    """The release checkpoint's [(key, shape)] for ``size``, in state_dict order."""
    return [(k, tuple(v.shape)) for k, v in ReleasePerViT(size).state_dict().items()]
