"""A short tour of the posattn core: one attention layer, every registered Φp.

    .venv/bin/python examples/quickstart.py

Builds ``posattn.Attention`` with each Φp on a non-square 9 x 12 grid with a class token,
runs a training step, then shows what PerViT's peripheral Φp looks like at the release's
initialisation: local in the first layer, nearly uniform in the last.
"""
import time

import torch

import posattn
from posattn import Attention, TokenGrid
from posattn.phi.peripheral import PeripheralPhi

SHADES = ' .:-=+*#%@'


def ascii_map(values: torch.Tensor) -> str:
    """One character per key on the fixed scale of the peripheral Φp, a sigmoid: ' ' for 0 up to
    '@' for 1 in equal steps. Every map is drawn on that one scale, so a flat map draws flat."""
    levels = (values.clamp(0, 1) * (len(SHADES) - 1)).round().long()
    return '\n'.join(''.join(SHADES[i] for i in row) for row in levels.tolist())


def main() -> None:
    torch.manual_seed(0)
    grid = TokenGrid(9, 12, num_prefix_tokens=1)
    x = torch.randn(4, grid.num_tokens, 64)
    print(f'posattn {posattn.__version__}: Φp registered: {", ".join(posattn.list_phis())}')
    print(f'input {tuple(x.shape)} on a {grid}\n')
    print(f'{"Φp":<12}{"Φp params":>10}{"out":>16}{"fwd+bwd ms":>12}')
    for name in posattn.list_phis():
        layer = Attention(64, 4, phi=name, num_prefix_tokens=1)
        layer(x, grid).sum().backward()  # first call builds per-grid tables
        start = time.perf_counter()
        out = layer(x, grid)
        out.square().mean().backward()
        elapsed = (time.perf_counter() - start) * 1e3
        params = sum(p.numel() for p in layer.phi.parameters())
        print(f'{name:<12}{params:>10}{str(tuple(out.shape)):>16}{elapsed:>12.1f}')

    print('\nPerViT peripheral Φp at the release initialisation, query at the grid centre (row 4, col 6),')
    print(f'on one scale for every layer: {SHADES!r} from 0 (blocked) to 1 (let through)')
    centre = 4 * 12 + 6
    for layer_index in (0, 6, 11):
        phi = PeripheralPhi(num_heads=4, layer_index=layer_index, num_layers=12)
        with torch.no_grad():
            values = phi.position_attention(9, 12)[0, centre].view(9, 12)
        print(f'\nlayer {layer_index}: Φp from {values.min():.3f} to {values.max():.3f}')
        print(ascii_map(values))


if __name__ == '__main__':
    main()
