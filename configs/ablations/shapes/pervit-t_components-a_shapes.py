# The embedded replication of PerViT's study (tools/compare_phis.py --experiment ablations),
# row (a): PerViT-T itself, on an 8 x 8 token grid. The stem has three stride-2 convolutions
# instead of four (stride 8), so that the 64 x 64 images of PositionalShapes give 8 x 8 tokens,
# enough cells for Φp to take a shape. Half the images and 7 epochs (329 steps) keep each run
# near 8 minutes on 2 CPU cores; every row of the experiment shares this budget.
_base_ = ['../../pervit_t_shapes.py']

max_epochs = 7
model = dict(backbone=dict(arch=dict(_delete_=True, embed_dims=(128, 192, 224, 280), depths=(2, 2, 6, 2),
                                     num_heads=4, stem_dims=(48, 64, 96))))
train_dataloader = dict(dataset=dict(num_images=3000))
val_dataloader = dict(dataset=dict(num_images=600))
test_dataloader = val_dataloader
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-2, by_epoch=True, end=1, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=1, end=max_epochs,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=max_epochs)
