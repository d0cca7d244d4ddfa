"""Seeded random weights and images for a PerViT release checkpoint layout.

The release fixtures were computed with weights drawn this way rather than stored: one float64
generator draws a standard normal tensor per key, in state_dict order, and each is scaled by the
role its name gives it. Every tensor then differs from the release's constant initialisation, so
a converter that transposes, flips or reorders one cannot agree with the fixture by chance.

    weights = release_state_dict(release_spec('tiny'), seed=7)   # {key: float32 tensor}
    images = release_input(seed=7)                              # (2, 3, 224, 224)
"""
import math

import torch


def _is_normalisation(name):
    """Norm layers of the release: *norm*, the Φp's group norms gn1 / gn2, the stem's BatchNorms."""
    stem_norm = name.startswith('conv_layers.conv_layers.') and '.1.' in name
    return 'norm' in name or '.gn1.' in name or '.gn2.' in name or stem_norm


def _scaled(name, shape, normal):
    """The value of tensor ``name`` from its standard normal draw ``normal`` (float64)."""
    if name.endswith('running_var'):
        return 0.5 + 0.5 * normal.abs()
    if name.endswith('running_mean'):
        return 0.1 * normal
    if name.endswith('gn2.weight'):          # v_l, how strongly the peripheral gate acts
        return 1.0 + 0.5 * normal
    if name.endswith('gn2.bias'):            # s_l, how far the peripheral gate reaches
        return 1.5 * normal
    if name.startswith('rpe_proj.'):         # the distance embedding shared by every layer
        return 0.5 * normal
    if _is_normalisation(name):
        return 1.0 + 0.1 * normal if name.endswith('weight') else 0.05 * normal
    if name.endswith('bias'):
        return 0.02 * normal
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1   # linear and conv weights
    return normal / math.sqrt(fan_in)


def release_state_dict(spec, seed):
    """A release-layout state_dict for ``spec`` = [(key, shape)]; float32 but for the int64 counters."""
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for name, shape in spec:
        if name.endswith('num_batches_tracked'):   # drawn nothing: the generator skips these keys
            state_dict[name] = torch.tensor(0, dtype=torch.int64)
            continue
        normal = torch.randn(shape, generator=generator, dtype=torch.float64)
        state_dict[name] = _scaled(name, shape, normal).float()
    return state_dict


def release_input(seed, batch=2, size=224):
    """The fixture's images: a standard normal (batch, 3, size, size) from seed + 1."""
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed + 1))
