# mmengine runtime shared by every config: mmpretrain's scope, posattn's registrations, hooks.
default_scope = 'mmpretrain'
# Registers PosattnPerViT / PosattnViT, the datasets, and the weights-only checkpoint loader.
custom_imports = dict(imports=['integrations.openmmlab'], allow_failed_imports=False)

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=100),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=3, save_best='auto'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='VisualizationHook', enable=False),
)

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    # torchrun on GPUs: nccl; tools/train.py switches to gloo when there is no GPU.
    dist_cfg=dict(backend='nccl'),
)

vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='UniversalVisualizer', vis_backends=vis_backends)

log_level = 'INFO'
load_from = None
resume = False
randomness = dict(seed=0, deterministic=False)
