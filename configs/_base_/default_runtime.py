# mmengine runtime shared by every classification config: mmpretrain's scope, posattn's
# registrations, the runner, hooks.
default_scope = 'mmpretrain'
# Registers PosattnPerViT / PosattnViT, the datasets, and the runner (weights-only checkpoint
# loading, atomic checkpoint writes) and hooks below.
custom_imports = dict(imports=['posattn_openmmlab'], allow_failed_imports=False)
# Strict checkpoint loading, resume from the newest complete checkpoint, one training per
# work_dir, exact resume (integrations/openmmlab/runner.py).
runner_type = 'PosattnRunner'
# True loads the weights of a checkpoint that fit and logs the others (tools: --partial-load).
partial_load = False

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=100),
    param_scheduler=dict(type='ParamSchedulerHook'),
    # CheckpointHook that removes old checkpoints only once the new one is complete
    checkpoint=dict(type='SafeCheckpointHook', interval=1, max_keep_ckpts=3, save_best='auto'),
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
