"""Model tooling (`lorafn model ...`): pulling real models, random models of real shapes, their tokenizer.

Not part of the runtime: a worker serves a model directory and never imports this package.
"""
