# mmpretrain's DeiT-T trained from scratch, then fine-tuned from its checkpoint (the same seed's)
# with each Φp swapped in by PosattnSwappedBackbone. The fine-tunes' configs take the starting
# checkpoint in the two keys every row's checkpoint_keys default to.
rows = [
    dict(name='deit_t', config='swap/deit-t_shapes.py',
         label="mmpretrain's DeiT-T (abs. embedding), from scratch"),
    dict(name='finetune_none', config='swap/deit-t_finetune-none_shapes.py',
         label="DeiT-T fine-tuned, + plain attention ('none')", start_from='deit_t'),
    dict(name='finetune_peg', config='swap/deit-t_finetune-peg_shapes.py',
         label='DeiT-T fine-tuned, + CPVT (PEG)', start_from='deit_t'),
    dict(name='finetune_irpe', config='swap/deit-t_finetune-irpe_shapes.py',
         label='DeiT-T fine-tuned, + iRPE-K', start_from='deit_t'),
    dict(name='finetune_peripheral', config='swap/deit-t_finetune-peripheral_shapes.py',
         label='DeiT-T fine-tuned, + PPE (peripheral)', start_from='deit_t'),
]
work_dir = 'work_dirs/compare_phis/swap'
