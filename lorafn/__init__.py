"""lorafn: serverless LoRA functions on Kubernetes GPUs.

The components live as subpackages of one package (see docs/architecture.md for why).
"""

__version__ = "0.1.0"
