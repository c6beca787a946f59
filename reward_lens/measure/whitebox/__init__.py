"""Whitebox instruments: need the policy's weights and torch (the ``whitebox`` extra).

* ``kl.py`` -- the exact denominator D_t = KL(pi_{t+1} || pi_t) from two checkpoints, as the
  full-vocabulary token-level KL summed over sequences sampled from the post-step policy.
* ``scores.py`` -- per-sequence score vectors grad log pi(y|x) for the rung-2 Fisher-kernel
  metric (``metric_g(method="fisher_kernel", scores=...)``), with a memory check first.
* ``fisher.py`` -- the empirical-Fisher quadratic 1/2 dtheta^T F dtheta, refused as a D_t.

Nothing outside this package imports torch.
"""
