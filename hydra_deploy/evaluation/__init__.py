"""Running a model and measuring it: uncertainty evaluation (``hydra-eval``) and backend parity
(``hydra-compare``). Above ``engines`` (it runs models through them) and ``export`` (it rebuilds
the PyTorch reference); below ``cli``.

- :mod:`hydra_deploy.evaluation.evaluate`: ``evaluate`` / ``write_report`` (hydra-eval);
- :mod:`hydra_deploy.evaluation.compare`: ``compare_export`` (hydra-compare).
"""
