# PerViT's transfer study (supplement Tab. A4): PerViT-M fine-tuned on CIFAR-100 from its ImageNet
# checkpoint (91.4% top-1), with the CIFAR-10 config's recipe (DeiT's for CIFAR); only the data
# changes: mmpretrain's CIFAR100, the python batches under data/cifar100.
_base_ = ['./pervit-m_transfer-cifar10.py']

num_classes = 100
data_preprocessor = dict(num_classes=num_classes)
model = dict(head=dict(num_classes=num_classes))
train_dataloader = dict(dataset=dict(type='CIFAR100', data_root='data/cifar100'))
val_dataloader = dict(dataset=dict(type='CIFAR100', data_root='data/cifar100'))
test_dataloader = val_dataloader
