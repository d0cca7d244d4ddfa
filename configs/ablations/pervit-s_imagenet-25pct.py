# PerViT's data-efficiency study (paper Table 4): PerViT-S trained on 25% of ImageNet-1k (each
# class subsampled, seed 0) for 1200 epochs, so that it sees as many images as the 300-epoch recipe
# of ../pervit_s_imagenet.py; warmup scaled alike to 20 epochs (67.5% top-1, DeiT-S 61.8%).
_base_ = ['../pervit_s_imagenet.py']
train_dataloader = dict(
    dataset=dict(_delete_=True, type='SubsampledDataset', fraction=0.25, seed=0,
                 dataset={{_base_.train_dataloader.dataset}}))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=20, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=20),
]
train_cfg = dict(max_epochs=1200)
