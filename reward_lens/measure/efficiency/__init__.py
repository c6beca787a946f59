"""The cost book (series F3, specification section 3.1.4).

KL_min = 1/2 dz^T G^-1 dz per step pair, its exact Shapley shares over the named features,
and the efficiency eta_t = KL_min / D_t, which is never handed out outside [0, 1].
"""

from reward_lens.measure.efficiency.cost import CostBook, CostRow, KlMinRow, KlMinSeries, cost_series, kl_min_series
from reward_lens.measure.efficiency.metric import MetricG, metric_g
from reward_lens.measure.efficiency.shapley import EXACT_MAX_FEATURES, ShapleyLimitError, kl_min, shapley_shares

__all__ = [
    "EXACT_MAX_FEATURES",
    "CostBook",
    "CostRow",
    "KlMinRow",
    "KlMinSeries",
    "MetricG",
    "ShapleyLimitError",
    "cost_series",
    "kl_min",
    "kl_min_series",
    "metric_g",
    "shapley_shares",
]
