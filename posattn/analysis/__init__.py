"""What position-aware attention learned: PerViT's analyses (Sec. 4.1, Appendix B) for any posattn model.

    maps = collect_attention_maps(model, images)          # {layer: Φc, Φa, Φp} for a few images
    measures = measure_attention(model, loader_of_images)  # Ω, Ψ, peripheral regions per layer and head
    plot_measures(measures, 'measures.png')                # and plot_position_maps, plot_sample_attention

``plot_training_curve`` draws a training run's loss and validation metrics from plain dicts.
"""
from .collect import AttentionMaps, LayerMeasures, attention_maps, collect_attention_maps, measure_attention
from .figures import plot_measures, plot_position_maps, plot_sample_attention, plot_training_curve
from .metrics import REGIONS, impact, nonlocality, region_radii, region_scores, token_distances

__all__ = ['AttentionMaps', 'LayerMeasures', 'attention_maps', 'collect_attention_maps', 'measure_attention',
           'plot_measures', 'plot_position_maps', 'plot_sample_attention', 'plot_training_curve', 'REGIONS',
           'impact', 'nonlocality', 'region_radii', 'region_scores', 'token_distances']
