"""Third-party training loops (PyTorch Lightning, Hugging Face's Trainer) on the own-loop API.

Each module imports its framework at import time; nothing else in the package imports this one (the fork
server preloads a module by name). The public import paths are ``elastic_train.lightning`` and
``elastic_train.hf``.
"""
