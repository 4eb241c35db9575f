"""The worker process torchrun runs: ``python -m elastic_train.worker --config job.yaml``.

Importing this package is cheap; torch is imported only when the worker runs.
"""
