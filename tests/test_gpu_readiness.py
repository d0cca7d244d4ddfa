"""What can be checked of the GPU path on a machine without one, and on one with ``--device cuda``.

- A training step (forward, loss, backward) of every model runs on the ``meta`` device, which
  like CUDA refuses to mix its tensors with CPU tensors and has no values to read on the host:
  every op's outputs are on the model's device, except the grid constants
  (:func:`posattn._cache.grid_constant`), computed on the CPU once per grid and device.
- No float64 tensor of the step on the model's device grows with N^2 (N tokens).
- The route ``biased_attention`` takes on CUDA (SDPA with a bias that requires grad), forced on
  the CPU, gives the CPU kernel's values and gradients in float64; with ``--device cuda`` the
  route runs on the device itself, in float64 and in float32 (SDPA's CUDA kernels).
- 20 training steps of PerViT-T on the embedded shapes set under bf16 autocast track fp32's
  losses, on the ``--device`` of the run.
"""
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import posattn
from posattn import functional
from posattn._cache import grid_constant
from posattn.functional import attention_probs, biased_attention

from conftest import REPO

NUM_CLASSES = 6


def model_specs(window_size):
    """name -> (create_model arguments), every model a training step is checked on: PerViT-T, the
    windowed + global PerViT-T of the detection configs, and the ViT with each Φp (iRPE also on
    q, k and v, which takes the materialised-probabilities path and the value term)."""
    specs = {
        'pervit_tiny': ('pervit_tiny', {}),
        'pervit_tiny_windowed': ('pervit_tiny', dict(window_size=window_size, global_blocks=(3, 7, 11),
                                                     drop_path_rate=0.1)),
        'vit_tiny_irpe_qkv': ('vit_tiny', dict(phi='irpe', phi_cfg=dict(on='qkv'))),
        'vit_tiny_rope_mixed': ('vit_tiny', dict(phi='rope', phi_cfg=dict(frequencies='mixed'))),
    }
    for phi in posattn.list_phis():
        specs[f'vit_tiny_{phi}'] = ('vit_tiny', dict(phi=phi))
    return specs


# 64 x 64 images: a 4 x 4 grid, cut into 2 x 2 windows of 3 x 3 (padded, so the key mask is used).
SMALL = model_specs(window_size=3)
# 224 x 224 images: the 14 x 14 ImageNet grid; the windowed model at 240 x 240, a 15 x 15 grid in
# 2 x 2 padded windows of the configs' 14 x 14, with global blocks over all 225 tokens.
IMAGENET = model_specs(window_size=14)


def image_size(name):
    return 240 if name == 'pervit_tiny_windowed' else 224


def shortest_sequence(name):
    """Tokens of the shortest attention sequence of the step at :func:`image_size`."""
    return 197 if name.startswith('vit_') else 196  # the ViT's class token; PerViT's grid or window


def build_on_meta(spec):
    name, kwargs = spec
    with torch.device('meta'):
        return posattn.create_model(name, num_classes=NUM_CLASSES, **kwargs).train()


def meta_step(model, batch, size):
    """Forward, cross-entropy loss and backward on meta inputs; returns the loss."""
    images = torch.randn(batch, 3, size, size, device='meta')
    labels = torch.randint(0, NUM_CLASSES, (batch,), device='meta')
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    return loss


# Every function grid_constant wraps runs the same wrapper code: a frame of it on the stack means
# the op computes a grid constant.
_GRID_CONSTANT_CODE = grid_constant(1)(lambda: None).__code__


def _inside_grid_constant():
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is _GRID_CONSTANT_CODE:
            return True
        frame = frame.f_back
    return False


class OpRecorder(TorchDispatchMode):
    """Records (op, device type, dtype, shape, numel, inside a grid constant) of every tensor each
    op returns, in forward and backward; the last field only for tensors off the meta device."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for out in tree_flatten(result)[0]:
            if isinstance(out, torch.Tensor):
                in_constant = _inside_grid_constant() if out.device.type != 'meta' else None
                self.outputs.append((str(func), out.device.type, out.dtype, tuple(out.shape), out.numel(),
                                     in_constant))
        return result


@pytest.mark.parametrize('name', list(SMALL))
def test_training_step_stays_on_the_model_device(name):
    """Built under ``torch.device('meta')``, a training step on meta inputs runs: no op mixes in a
    CPU tensor (meta refuses that, as CUDA does) and none reads a value on the host (``.item()``
    raises on meta). The only CPU work is the grid constants' (distance moments, iRPE bucket ids),
    cached per grid and device on a real device, so after the first step there is none."""
    model = build_on_meta(SMALL[name])
    assert all(p.device.type == 'meta' for p in model.parameters())
    recorder = OpRecorder()
    with recorder:
        loss = meta_step(model, batch=2, size=64)
    assert loss.device.type == 'meta' and loss.dtype == torch.float32
    for param_name, param in model.named_parameters():
        assert param.grad is not None and param.grad.device.type == 'meta', param_name
        assert param.grad.shape == param.shape, param_name
    stray = [out for out in recorder.outputs if out[1] != 'meta' and not out[5]]
    assert not stray, f'ops outside the grid constants made tensors off the model device: {stray[:10]}'
    on_cpu = [out for out in recorder.outputs if out[1] != 'meta']
    has_grid_constants = 'peripheral' in name or 'pervit' in name or 'irpe' in name
    assert bool(on_cpu) == has_grid_constants  # the check sees them where there are some


def float64_outputs(name, batch):
    model = build_on_meta(IMAGENET[name])
    recorder = OpRecorder()
    with recorder:
        meta_step(model, batch=batch, size=image_size(name))
    on_device = [out for out in recorder.outputs if out[1] == 'meta']
    return on_device, [out[:5] for out in on_device if out[2] == torch.float64]


@pytest.mark.parametrize('name', list(IMAGENET))
def test_no_float64_tensor_on_the_device_grows_with_tokens_squared(name):
    """Rule: an op output on the model's device that is float64 and has >= N^2 elements fails, N the
    tokens of the step's shortest attention sequence (every logits, Φp or bias-gradient tensor has
    at least that many). What is float64 on the device is the peripheral Φp's IN1 statistics
    (distance moments, PP1's canvas, their per-window means and variances): at most 9 x hidden x
    N_grid elements (28,224 for PerViT-T at 14 x 14, against N^2 = 38,416), and the same at any
    batch size: it is computed once per grid, not per image."""
    tokens = shortest_sequence(name)
    on_device, float64 = float64_outputs(name, batch=2)
    too_large = [out for out in float64 if out[4] >= tokens ** 2]
    assert not too_large, f'float64 outputs with >= N^2 = {tokens ** 2} elements: {too_large[:10]}'
    if 'peripheral' in name or 'pervit' in name:
        # the rule is not empty: the Φp bias, (1, heads, N, N), is there in float32
        assert float64 and any(out[2] == torch.float32 and out[4] >= tokens ** 2 for out in on_device)
        assert float64_outputs(name, batch=3)[1] == float64  # batch-free
    else:
        assert not float64


def qkv_bias_mask(bias_shape, masked):
    """float64 q, k, v (3, 2 heads, 7 tokens, 4), a bias of ``bias_shape`` or None, and a key
    mask (sequence 0 keeps some keys, 1 none, 2 all) or None."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=generator, dtype=torch.float64)
    key_mask = None
    if masked:
        key_mask = torch.ones(3, 7, dtype=torch.bool)
        key_mask[0, :3] = False
        key_mask[1] = False
    upstream = torch.randn(3, 2, 7, 4, generator=generator, dtype=torch.float64)
    return (q, k, v, bias), key_mask, upstream


def values_and_gradients(attend, tensors, key_mask, upstream):
    inputs = [t.clone().requires_grad_() for t in tensors if t is not None]
    out = attend(*inputs[:3], inputs[3] if len(inputs) == 4 else None, key_mask)
    return [out] + list(torch.autograd.grad((out * upstream).sum(), inputs))


def through_probs(q, k, v, bias, key_mask):
    return attention_probs(q, k, bias, key_mask) @ v


class _TorchWithGradModeOff:
    """torch as ``posattn.functional`` sees it, but ``is_grad_enabled()`` answers False: the one
    term of the route test ``bias.requires_grad and q.device.type == 'cpu' and
    torch.is_grad_enabled()`` that can be flipped on CPU tensors. Autograd itself stays on."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def is_grad_enabled():
        return False


class _NoCpuKernel:
    @staticmethod
    def apply(*args):
        raise AssertionError('biased_attention took the CPU kernel, not the CUDA route')


def cuda_route(tensors, key_mask, upstream, device, monkeypatch, dtype=torch.float64):
    """Values and gradients of ``biased_attention`` on the route it takes on CUDA, in ``dtype``, as
    float64 CPU tensors: run on ``device`` where that is a CUDA device, else forced on the CPU."""
    if device.type == 'cuda':
        moved = [None if t is None else t.to(device, dtype) for t in tensors]
        results = values_and_gradients(biased_attention, moved, None if key_mask is None else key_mask.to(device),
                                       upstream.to(device, dtype))
        return [r.to('cpu', torch.float64) for r in results]
    with monkeypatch.context() as patch:
        patch.setattr(functional, 'torch', _TorchWithGradModeOff())
        patch.setattr(functional, '_BiasedAttention', _NoCpuKernel)
        return values_and_gradients(biased_attention, tensors, key_mask, upstream)


# float32 against float64 on CUDA: SDPA's memory-efficient kernel accumulates in float32 (its matmuls
# in full float32 precision), over 7 keys and 4 channels of O(1) values: rounding errors of a few
# 1e-7; 1e-5 leaves more than 10x for the online softmax's rescaling.
FLOAT32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('bias_shape,masked', [
    ((3, 2, 7, 7), True), ((1, 2, 7, 7), False), ((1, 2, 7, 7), True), (None, False), (None, True)],
    ids=['bias-B-key-mask', 'bias-batch-free', 'bias-batch-free-key-mask', 'no-bias', 'no-bias-key-mask'])
def test_cuda_route_matches_the_cpu_kernel(monkeypatch, device, bias_shape, masked):
    """On CUDA a bias that requires grad goes to SDPA as ``attn_mask`` (its memory-efficient kernel
    returns the bias gradient) instead of the CPU kernel's tiled backward. That route gives the CPU
    kernel's output and gradients of q, k, v and the bias, and both give the materialised
    softmax(q k^T / sqrt(d) + bias) v, to 1e-10 in float64. A batch-free bias gets a batch-free
    gradient, and a sequence with no key gets zero output and gradients. Without a bias both
    devices call SDPA alike. On the CPU the route is forced on CPU tensors (CUDA's kernels are not
    run); with ``--device cuda`` it runs there, in float64 (SDPA's math backend) and in float32
    (the kernels training uses), the latter to :data:`FLOAT32_TOLERANCE`."""
    tensors, key_mask, upstream = qkv_bias_mask(bias_shape, masked)
    cpu_kernel = values_and_gradients(biased_attention, tensors, key_mask, upstream)
    expected = values_and_gradients(through_probs, tensors, key_mask, upstream)
    cuda = cuda_route(tensors, key_mask, upstream, device, monkeypatch)
    for got, cpu, want in zip(cuda, cpu_kernel, expected):
        assert got.shape == cpu.shape == want.shape
        torch.testing.assert_close(got, cpu, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if device.type == 'cuda':
        for got, want in zip(cuda_route(tensors, key_mask, upstream, device, monkeypatch, torch.float32), expected):
            torch.testing.assert_close(got, want, **FLOAT32_TOLERANCE)
    if masked:
        out, grad_q, grad_k, grad_v = cuda[:4]
        assert out[1].abs().max() == 0 and out[0].abs().max() > 0
        assert all(g[1].abs().max() == 0 for g in (grad_q, grad_k, grad_v))


STEPS, BATCH = 20, 8
# bf16 keeps 8 significant bits: each rounding has relative error <= u = 2^-8. Under autocast a
# PerViT-T forward runs about 80 matmuls, convolutions and attentions in bf16 (Φp stays fp32);
# their rounding errors are independent and largely cancel in the batch-mean loss. Here the loss
# moves by at most 0.83 u in any of the 20 steps (0.15 u at the first, where the weights are still
# equal; later steps add the drift of the weights), so 2u (0.78%) leaves 2.4x headroom for other
# CPUs' bf16 GEMMs, while the loss itself changes by a median 9% from one batch to the next. CUDA's
# bf16 matmuls, convolutions and attention kernels round the same inputs to bf16 and accumulate in
# fp32 too (the bound is not yet confirmed there).
BF16_RELATIVE_TOLERANCE = 2 * 2.0 ** -8


def render_shapes(count, img_size, seed):
    """The embedded shapes set (``posattn_openmmlab.shapes_dataset.render_shapes``), read from its
    file: it needs numpy alone, and the OpenMMLab package's import would need the whole stack."""
    spec = importlib.util.spec_from_file_location('shapes_dataset', REPO / 'integrations/openmmlab/shapes_dataset.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render_shapes(count, img_size=img_size, seed=seed)


def shapes_losses(autocast, device):
    """The per-step losses of PerViT-T trained for ``STEPS`` steps on the embedded shapes set (64 x 64,
    the shapes configs' normalisation, AdamW at their learning rate) on ``device``, same seed and batches."""
    images, labels = render_shapes(STEPS * BATCH, img_size=64, seed=0)
    images = (torch.from_numpy(images).permute(0, 3, 1, 2).float() - 127.5) / 64.0
    labels = torch.from_numpy(labels)
    torch.manual_seed(0)
    model = posattn.create_model('pervit_tiny', num_classes=NUM_CLASSES).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.05)
    losses, logits_dtypes = [], set()
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(images[batch].to(device))
            loss = F.cross_entropy(logits, labels[batch].to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        logits_dtypes.add(logits.dtype)
    return torch.tensor(losses, dtype=torch.float64), logits_dtypes


@pytest.mark.slow
def test_bf16_autocast_tracks_fp32_losses(device):
    fp32, fp32_dtypes = shapes_losses(autocast=False, device=device)
    bf16, bf16_dtypes = shapes_losses(autocast=True, device=device)
    assert fp32_dtypes == {torch.float32} and bf16_dtypes == {torch.bfloat16}
    assert torch.isfinite(bf16).all() and not torch.equal(bf16, fp32)  # bf16 did run
    relative = (bf16 - fp32).abs() / fp32
    assert relative.max() <= BF16_RELATIVE_TOLERANCE, relative.tolist()


def test_the_release_formula_runs_on_its_weights_device():
    """posattn.reference's Φp (the benchmarks' release baseline) makes its coordinates where its
    weights are: on the meta device, as on CUDA, nothing is created on the CPU."""
    from posattn import reference
    phi = posattn.Attention(16, 2, phi='peripheral').to('meta').phi
    position = reference.peripheral_position_attention(3, 4, phi.weights())
    assert position.device.type == 'meta' and position.shape == (2, 12, 12)
