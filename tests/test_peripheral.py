"""The peripheral Φp against the release's computation (float64 reference and fixture); the tests
that take ``device`` compute Φp on ``pytest --device`` (conftest.py), the references on the CPU."""
import pytest
import torch

import posattn
from posattn.phi import peripheral_kernel
from posattn.phi.peripheral import DistanceEmbedding, PeripheralPhi, PeripheralWeights, peripheral_init

from posattn.convert import pervit_from_release
from posattn.reference import peripheral_position_attention

from conftest import randomise_peripheral
from release_fixtures import pervit_fixture

GRIDS = [(14, 14), (3, 4), (5, 9), (1, 1), (1, 5), (6, 1), (2, 2)]


def make_phi(num_heads, seed, dtype=torch.float64):
    return randomise_peripheral(PeripheralPhi(num_heads).to(dtype), seed)


def release_phi(phi, height, width):
    """Φp computed the straightforward way, as the release does (posattn.reference)."""
    with torch.no_grad():
        return peripheral_position_attention(height, width, phi.weights())


@pytest.mark.parametrize('height,width', GRIDS)
def test_shortcuts_equal_straightforward_release_computation(height, width, device):
    phi = make_phi(num_heads=2, seed=height * 31 + width)
    slow = release_phi(phi, height, width)
    with torch.no_grad():
        fast = phi.to(device).position_attention(height, width).cpu()
    assert fast.shape == (2, height * width, height * width)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10)


def test_gradients_equal_straightforward_release_computation(device):
    phi = make_phi(num_heads=2, seed=3)
    upstream = torch.rand(2, 20, 20, dtype=torch.float64)
    leaves = [w.detach().clone().requires_grad_() if w is not None else None for w in phi.weights()]
    (peripheral_position_attention(4, 5, PeripheralWeights(*leaves)) * upstream).sum().backward()
    phi.to(device)
    (phi.position_attention(4, 5) * upstream.to(device)).sum().backward()
    params = [w for w in phi.weights() if w is not None]  # the optional release biases are None
    leaves = [leaf for leaf in leaves if leaf is not None]
    names = {id(p): n for n, p in phi.named_parameters()}
    assert len(params) == len(names) == 7
    for param, leaf in zip(params, leaves):
        torch.testing.assert_close(param.grad.cpu(), leaf.grad, rtol=1e-8, atol=1e-10, msg=names[id(param)])


def test_biases_removed_by_instance_norms_change_nothing():
    """Why the Φp has no biases for w, PP1 and PP2: in the release's computation (the reference),
    large ones give the same Φp as none, and the Φp without them is the release's."""
    phi = make_phi(num_heads=2, seed=9)
    weights = phi.weights()
    generator = torch.Generator().manual_seed(4)
    biases = {name: torch.randn(size, generator=generator, dtype=torch.float64) * 3 for name, size in
              (('distance_bias', 8), ('proj1_bias', 8), ('proj2_bias', 2))}
    with torch.no_grad():
        without = peripheral_position_attention(5, 6, weights)
        with_biases = peripheral_position_attention(5, 6, weights._replace(**biases))
        torch.testing.assert_close(with_biases, without, rtol=0, atol=1e-12)
        torch.testing.assert_close(phi.position_attention(5, 6), without, rtol=0, atol=1e-10)
    assert not {'proj1_bias', 'proj2_bias', 'distance_embedding.bias'} & set(phi.state_dict())


def test_chunked_recomputation_matches_one_pass(monkeypatch, device):
    phi = make_phi(num_heads=2, seed=5)
    release = release_phi(phi, 6, 7)
    phi.to(device)
    upstream = torch.rand(2, 42, 42, dtype=torch.float64).to(device)
    (phi.position_attention(6, 7) * upstream).sum().backward()
    one_pass = {n: p.grad.clone() for n, p in phi.named_parameters()}
    phi.zero_grad()
    monkeypatch.setattr(peripheral_kernel, '_CHUNK_ELEMENTS', 1000)  # 10 queries a chunk, recomputed
    value = phi.position_attention(6, 7)
    (value * upstream).sum().backward()
    torch.testing.assert_close(value.cpu(), release, rtol=0, atol=1e-10)
    for name, param in phi.named_parameters():
        torch.testing.assert_close(param.grad, one_pass[name], rtol=1e-10, atol=1e-12, msg=name)


def test_fp32_tracks_float64_path(device):
    """float32 on the device against float64 on the CPU."""
    phi64 = make_phi(num_heads=4, seed=11)
    phi32 = PeripheralPhi(4)
    phi32.load_state_dict({k: v.float() for k, v in phi64.state_dict().items()})
    with torch.no_grad():
        value32 = phi32.to(device).position_attention(14, 14).cpu()
        error = (value32.double() - phi64.position_attention(14, 14)).abs().max()
    assert error < 2e-5


@pytest.mark.parametrize('kind', ['trimmed', 'full'])
def test_fixture_all_layers_of_pervit_tiny(kind, device):
    """Φp of the 12 layers of the release's PerViT-T (seed-7 weights) within 1e-4 (the trimmed
    fixture keeps six query rows of each)."""
    fixture = pervit_fixture(kind)
    state = pervit_from_release(fixture['weights'])
    shared = DistanceEmbedding(16)
    shared.load_state_dict({'weight': state['distance_embedding.weight']})
    shared.to(device)  # not a submodule of the Φp that read it: given with each call
    for layer in range(12):
        phi = PeripheralPhi(4, layer_index=layer, num_layers=12, shared_embedding=True)
        prefix = f'blocks.{layer}.attn.phi.'
        phi.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        with torch.no_grad():
            value = phi.to(device).position_attention(14, 14, shared)[:, fixture['tokens'].to(device)].cpu()
        torch.testing.assert_close(value, fixture['phi_p'][layer], rtol=0, atol=1e-4, msg=f'layer {layer}')


def test_release_initialisation():
    assert peripheral_init(0, 12) == (-5.0, 3.0)
    assert peripheral_init(11, 12) == pytest.approx((4.0, 0.01))
    assert peripheral_init(0, 1) == (-5.0, 3.0)
    phi = PeripheralPhi(4, layer_index=3, num_layers=12)
    s, v = peripheral_init(3, 12)
    assert torch.all(phi.norm2_bias == torch.tensor(s, dtype=torch.float32))
    assert torch.all(phi.norm2_weight == torch.tensor(v, dtype=torch.float32))
    assert torch.all(phi.distance_embedding.weight == -0.02)
    assert torch.all(phi.proj1_weight == 0.02) and torch.all(phi.proj2_weight == 0.02)
    with pytest.raises(ValueError, match='layer_index 12 is outside 0..11'):
        peripheral_init(12, 12)


def test_initial_phi_is_local_and_heads_agree():
    """At the release init every head gives the same map, peaked at the query (PerViT App. A)."""
    phi = PeripheralPhi(4, layer_index=0, num_layers=12)
    with torch.no_grad():
        value = phi.position_attention(7, 7)
    torch.testing.assert_close(value, value[:1].expand_as(value))
    centre = 3 * 7 + 3
    assert value[0, centre].argmax() == centre


def test_a_shared_distance_embedding_is_given_with_each_call():
    """The model owns it; the Φp declares it as a call input and holds no reference."""
    shared = DistanceEmbedding(8)
    layer = posattn.Attention(16, 2, phi=PeripheralPhi(2, shared_embedding=True)).eval()
    assert 'phi.distance_embedding.weight' not in layer.state_dict() and layer.phi.call_inputs == ('distance_embedding',)
    assert 'distance_embedding.weight' in PeripheralPhi(2).state_dict()
    owned = posattn.Attention(16, 2, phi=PeripheralPhi(2)).eval()
    owned.load_state_dict({**layer.state_dict(), 'phi.distance_embedding.weight': shared.weight.detach()})
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, (3, 4), distance_embedding=shared), owned(x, (3, 4)), rtol=0, atol=0)
        shared.weight.mul_(3)  # what it reads is what the call gives
        assert not torch.allclose(layer(x, (3, 4), distance_embedding=shared), owned(x, (3, 4)))
    with pytest.raises(TypeError, match='reads distance_embedding given with each call'):
        layer(x, (3, 4))
    with pytest.raises(TypeError, match='got distance_embedding with the call; .* reads nothing'):
        owned(x, (3, 4), distance_embedding=shared)
    with pytest.raises(ValueError, match='reads a DistanceEmbedding of 8 channels .* got DistanceEmbedding of 16'):
        layer(x, (3, 4), distance_embedding=DistanceEmbedding(16))
