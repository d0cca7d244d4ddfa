"""The trimmed release fixtures of ``tests/fixtures``: what each keeps of the full reference files.

The full files (the released code's outputs; see ``tests/fixtures/README.md``) weigh 15 MB; the
trimmed ones keep exact float32 slices of them, a few hundred KB, so that parity with the releases
runs in every clone. The test suite checks that each trimmed file equals ``trim_*`` of its full
file wherever the full files are present. Write the trimmed files again with

    python tests/release_fixtures.py FOLDER_OF_THE_FULL_FIXTURES
"""
import sys
from pathlib import Path

import torch

TRIMMED = Path(__file__).resolve().parent / 'fixtures'

# (full file, trimmed file)
PERVIT = ('pervit_tiny_release_seed7.pt', 'pervit_tiny_release_seed7_trimmed.pt')
IRPE = ('irpe_ctx_product_shared_k_14x14_skip1.pt', 'irpe_ctx_product_shared_k_14x14_skip1_trimmed.pt')
PEG = ('peg_poscnn_192_14x14.pt', 'peg_poscnn_192_14x14_trimmed.pt')

# Tokens of the 14 x 14 grid kept of PerViT's Φp (query rows) and block outputs: the four corners,
# one off-centre and the centre: 0 (0, 0), 13 (0, 13), 52 (3, 10), 105 (7, 7), 182 (13, 0), 195 (13, 13).
PERVIT_TOKENS = torch.tensor([0, 13, 52, 105, 182, 195])
# Query rows kept of iRPE's bias: every fourth of the 197, the class token (row 0) included.
IRPE_ROWS = torch.arange(0, 197, 4)
# Channels kept of the depthwise PEG: every sixth of the 192 (a depthwise conv keeps them apart).
PEG_CHANNELS = torch.arange(0, 192, 6)


def trim_pervit(full):
    """Spec, seed and logits whole; Φp (heads, tokens, 196) and block outputs (B, tokens, C) of
    every layer at ``PERVIT_TOKENS``. The input is ``release_weights.release_input(seed)``."""
    tokens = PERVIT_TOKENS
    return {'model': full['model'], 'seed': full['seed'], 'spec': full['spec'],
            'logits': full['logits'].clone(), 'tokens': tokens.clone(),
            'phi_p': {i: phi[0][:, tokens].clone() for i, phi in full['phi_p'].items()},
            'block_out': {i: out[:, tokens].clone() for i, out in full['block_out'].items()}}


def trim_irpe(full):
    """The first image and head: q (1, 1, 197, 64), the shared table, every bucket id (as uint8)
    and the bias rows ``IRPE_ROWS`` (1, 1, rows, 197)."""
    assert full['bucket_ids'].max() < 256
    return {'q': full['q'][:1, :1].clone(), 'lookup_table_weight': full['lookup_table_weight'].clone(),
            'bucket_ids': full['bucket_ids'].to(torch.uint8), 'rows': IRPE_ROWS.clone(),
            'out': full['out'][:1, :1, IRPE_ROWS].clone()}


def trim_peg(full):
    """The first image and the channels ``PEG_CHANNELS`` of the input, the conv and the output."""
    channels = PEG_CHANNELS
    return {'H': full['H'], 'W': full['W'], 'channels': channels.clone(),
            'x': full['x'][:1, :, channels].clone(), 'weight': full['weight'][channels].clone(),
            'bias': full['bias'][channels].clone(), 'out': full['out'][:1, :, channels].clone()}


TRIMS = {PERVIT: trim_pervit, IRPE: trim_irpe, PEG: trim_peg}


def load_trimmed(name):
    return torch.load(TRIMMED / name, weights_only=True)


def pervit_fixture(kind):
    """The Tiny release fixture, ``kind`` 'trimmed' or 'full' (which skips where ../shared is
    absent), with its weights and images rebuilt, Φp as (heads, tokens, 196) and block outputs as
    (B, tokens, C) at ``tokens`` (every token for the full file)."""
    from conftest import load_fixture
    from release_weights import release_input, release_state_dict
    full_name, trimmed_name = PERVIT
    if kind == 'trimmed':
        data = load_trimmed(trimmed_name)
    else:
        data = load_fixture(full_name)
        data['phi_p'] = {i: phi[0] for i, phi in data['phi_p'].items()}
        data['tokens'] = torch.arange(data['phi_p'][0].shape[-1])
        assert torch.equal(data.pop('input'), release_input(data['seed']))
    data['input'] = release_input(data['seed'])
    data['weights'] = release_state_dict(data['spec'], data['seed'])
    return data


def main(full_folder):
    TRIMMED.mkdir(exist_ok=True)
    for (full_name, trimmed_name), trim in TRIMS.items():
        torch.save(trim(torch.load(Path(full_folder) / full_name, weights_only=True)), TRIMMED / trimmed_name)
        print(f'{trimmed_name}: {(TRIMMED / trimmed_name).stat().st_size / 1024:.0f} KiB')


if __name__ == '__main__':
    main(sys.argv[1])
