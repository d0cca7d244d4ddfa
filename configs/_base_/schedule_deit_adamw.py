# The DeiT / PerViT optimisation recipe (Table A6): 300 epochs, AdamW, lr 5e-4 * batch / 512,
# linear warmup then cosine decay to 1e-5, no weight decay on 1-D parameters and biases,
# no gradient clipping, no EMA. Per-model configs set weight decay and warmup length.
warmup_epochs = 5
optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=5e-4 * 1024 / 512, weight_decay=0.05, eps=1e-8, betas=(0.9, 0.999)),
    constructor='ParamwiseSummaryOptimWrapperConstructor',  # paramwise_cfg summarised in the log
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=warmup_epochs),
]
train_cfg = dict(by_epoch=True, max_epochs=300, val_interval=1)
val_cfg = dict()
test_cfg = dict()
# `tools/train.py --auto-scale-lr` rescales lr from this batch to the one actually used.
auto_scale_lr = dict(base_batch_size=1024)
