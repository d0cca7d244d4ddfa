"""Slow, literal float64 references written for the tests, independent of posattn's code paths.

They follow the PerViT release step by step (`../shared/spec/pervit.md`): the full
(query, key, channel) distance tensor, all 4 * heads channels, every bias the release carries,
and its L1-normalised attention.
"""
import torch
import torch.nn.functional as F


def padded_coordinates(n):
    """linspace(-1, 1, n) extended by 2 real steps on each side (a single row gets step 2)."""
    core = torch.linspace(-1, 1, n, dtype=torch.float64)
    step = 2.0 / (n - 1) if n > 1 else 2.0
    pad = step * torch.arange(1, 3, dtype=torch.float64)
    return torch.cat([(core[0] - pad).flip(0), core, core[-1] + pad])


def group_norm(x, weight, bias, eps=1e-5):
    """Per-(sample, channel) normalisation over the spatial dims, written out."""
    mean = x.mean(dim=(2, 3), keepdim=True)
    var = ((x - mean) ** 2).mean(dim=(2, 3), keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight[None, :, None, None] + bias[None, :, None, None]


def release_phi(height, width, w):
    """Φp (heads, H*W, H*W) as the release computes it, from release-named weights ``w``:
    rpe_w (D_r, 1), rpe_b, conv1_w, conv1_b, gn1_w, gn1_b, conv2_w, conv2_b, gn2_w, gn2_b."""
    ys, xs = padded_coordinates(height), padded_coordinates(width)
    coords = torch.stack(torch.meshgrid(ys, xs, indexing='ij'), dim=-1).reshape(-1, 2)
    offsets = coords[None, :, :] - coords[:, None, :]  # [q, k] = c_k - c_q
    distance = torch.sqrt((offsets ** 2).sum(-1))
    embedded = distance[..., None] * w['rpe_w'][:, 0] + w['rpe_b']  # (Nq', Nk', D_r)
    hp, wp = height + 4, width + 4
    embedded = embedded.reshape(hp, wp, hp * wp, -1)[2:-2, 2:-2]  # inner queries
    x = embedded.reshape(height * width, hp, wp, -1).permute(0, 3, 1, 2)
    x = torch.relu(group_norm(F.conv2d(x, w['conv1_w'], w['conv1_b']), w['gn1_w'], w['gn1_b']))
    x = group_norm(F.conv2d(x, w['conv2_w'], w['conv2_b']), w['gn2_w'], w['gn2_b'])
    heads = x.shape[1]
    return torch.sigmoid(x).reshape(height * width, heads, height * width).permute(1, 0, 2)


def random_release_weights(num_heads, generator, dtype=torch.float64):
    """Random release-layout Φp weights, dead biases included (they must not matter)."""
    c = 4 * num_heads

    def randn(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=generator, dtype=dtype) * scale + shift
    return dict(rpe_w=randn(c, 1, scale=0.5), rpe_b=randn(c, scale=0.5),
                conv1_w=randn(c, c, 3, 3, scale=1 / 12), conv1_b=randn(c, scale=0.1),
                gn1_w=randn(c, scale=0.1, shift=1.0), gn1_b=randn(c, scale=0.1),
                conv2_w=randn(num_heads, c, 3, 3, scale=1 / 12), conv2_b=randn(num_heads, scale=0.1),
                gn2_w=randn(num_heads, scale=0.5, shift=1.0), gn2_b=randn(num_heads, scale=1.5))


def load_release_weights(phi, w):
    """Copy release-named weights into a posattn PeripheralPhi."""
    with torch.no_grad():
        phi.distance_embedding.weight.copy_(w['rpe_w'])
        phi.distance_embedding.bias.copy_(w['rpe_b'])
        phi.proj1_weight.copy_(w['conv1_w'])
        phi.proj1_bias.copy_(w['conv1_b'])
        phi.norm1_weight.copy_(w['gn1_w'])
        phi.norm1_bias.copy_(w['gn1_b'])
        phi.proj2_weight.copy_(w['conv2_w'])
        phi.proj2_bias.copy_(w['conv2_b'])
        phi.norm2_weight.copy_(w['gn2_w'])
        phi.norm2_bias.copy_(w['gn2_b'])


def release_attention(x, qkv_w, qkv_b, proj_w, proj_b, num_heads, phi, num_prefix_tokens):
    """The release's MPA: normalize_L1(exp(S - rowmax S) * Φp) V, then proj; prefix pairs get Φp = 1."""
    batch, tokens, dim = x.shape
    head_dim = dim // num_heads
    q, k, v = (x @ qkv_w.T + qkv_b).reshape(batch, tokens, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) * head_dim ** -0.5
    weights = torch.ones(num_heads, tokens, tokens, dtype=x.dtype)
    weights[:, num_prefix_tokens:, num_prefix_tokens:] = phi
    attn = F.normalize(torch.exp(scores - scores.amax(-1, keepdim=True)) * weights, p=1, dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(batch, tokens, dim)
    return out @ proj_w.T + proj_b


def softmax_attention(x, qkv_w, qkv_b, proj_w, proj_b, num_heads, log_phi=None, num_prefix_tokens=0):
    """softmax(S + log Φp) V then proj, with log Φp given directly (exact for a sharp Φp)."""
    batch, tokens, dim = x.shape
    head_dim = dim // num_heads
    q, k, v = (x @ qkv_w.T + qkv_b).reshape(batch, tokens, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) / head_dim ** 0.5
    if log_phi is not None:
        bias = torch.zeros(num_heads, tokens, tokens, dtype=x.dtype)
        bias[:, num_prefix_tokens:, num_prefix_tokens:] = log_phi
        scores = scores + bias
    attn = torch.softmax(scores, dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(batch, tokens, dim)
    return out @ proj_w.T + proj_b
