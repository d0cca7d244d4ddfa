"""nn.DataParallel's replicas: each replica's Φp reads the replica's own shared distance embedding.

DataParallel builds a replica with ``module._replicate_for_data_parallel()`` for every module, then
rewires the registered submodules and sets each parameter to its device's copy. The helper below
does the same on the CPU (the copies are clones), so the test runs without GPUs.
"""
import torch

import posattn


def cpu_replica(network):
    modules = list(network.modules())
    index = {module: i for i, module in enumerate(modules)}
    copies = [module._replicate_for_data_parallel() for module in modules]
    for module, replica in zip(modules, copies):
        for key, child in module._modules.items():
            replica._modules[key] = None if child is None else copies[index[child]]
        for key, param in module._parameters.items():
            if param is None:
                replica._parameters[key] = None
            else:
                setattr(replica, key, param.detach().clone().requires_grad_(param.requires_grad))
    return copies[0]


def test_a_replica_reads_its_own_distance_embedding():
    torch.manual_seed(0)
    model = posattn.create_model('pervit_tiny', num_classes=3)
    replica = cpu_replica(model)
    assert replica.distance_embedding is not model.distance_embedding
    images = torch.randn(2, 3, 64, 64)
    expected = model(images)
    out = replica(images)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    assert model.distance_embedding.weight.grad is None  # the original is not reached
    assert replica.distance_embedding.weight.grad is not None
    assert all(block.attn.phi.distance_embedding is None for block in replica.blocks)  # given with each call
